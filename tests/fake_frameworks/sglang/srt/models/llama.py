"""sglang/srt/models/llama.py, in miniature: `load_weights(self, weights)` as sglang's models write it
(a dict of the named parameters, each loaded with its `weight_loader` or the default)."""

from typing import Iterable, Tuple

import torch
from torch import nn

from sglang.srt.model_loader.weight_utils import default_weight_loader


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.proj(self.embed_tokens(ids))))

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        params_dict = dict(self.named_parameters())
        for name, tensor in weights:
            if name in params_dict:
                wl = getattr(params_dict[name], "weight_loader", default_weight_loader)
                wl(params_dict[name], tensor)
                loaded.add(name)
        return loaded
