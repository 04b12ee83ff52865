"""vllm/model_executor/models/llama.py, in miniature: a causal LM whose `load_weights(self, weights)`
is vLLM's (an `AutoWeightsLoader` over the model), and a greedy `generate` for the tests' loops."""

from collections.abc import Iterable

import torch
from torch import nn

from vllm.model_executor.models.utils import AutoWeightsLoader


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.mlp = LlamaMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(self.input_layernorm(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + _causal(x.shape[-2]), dim=-1) @ v
        x = x + self.o_proj(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, intermediate: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden, intermediate) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights)


class LlamaForCausalLM(nn.Module):
    def __init__(self, *, vocab: int = 128, hidden: int = 32, intermediate: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.model = LlamaModel(vocab, hidden, intermediate, layers)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, tokens: int) -> torch.Tensor:
        for _ in range(tokens):
            ids = torch.cat([ids, self(ids)[:, -1:].argmax(-1)], dim=1)
        return ids

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights)
