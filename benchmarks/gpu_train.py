"""A small training job for `gpu_check.py`: run as is, or under `KVGUARD_TARGETS=autograd,weights`.

    python benchmarks/gpu_train.py [--model block|gpt2|llama] [--optimizer fused|foreach|for-loop]
                                   [--bf16] [--checkpoint] [--bug saved|weight] [--sync-check] [--steps N]

`gpu_check.py` starts it in fresh processes, plain and with the switch on
(`python -m kvguard run -- …`), so what it measures is what a user gets with no code change:
the bugs below caught at their lines, a clean run clean, no host-device synchronisation
added to a step, and the step time. It prints one `result: …` line (JSON) at the end.

`--bug saved` writes an activation that a linear layer saved for backward (inside the
checkpointed region with `--checkpoint`); `--bug weight` writes a weight between two
optimizer steps. Both lines are marked `# BUG:` so the checker can find them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

BUG: str = ""


class Block(nn.Module):
    """A pre-norm transformer block: attention (SDPA) then a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        u = F.gelu(self.fc1(self.ln2(x)))
        out = self.fc2(u)  # fc2 saves u for backward
        if BUG == "saved":
            u.mul_(0.5)  # BUG: saved-activation
        return x + out


class Net(nn.Module):
    def __init__(self, d: int = 256, heads: int = 4, layers: int = 4, vocab: int = 1024, ckpt: bool = False) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt and self.training else block(x)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def build(name: str, ckpt: bool, device: str) -> tuple[nn.Module, Any]:
    """The model and a loss function of `ids`, built from a config (random weights, nothing downloaded)."""
    if name == "block":
        model = Net(ckpt=ckpt, **({} if device == "cuda" else {"d": 64, "layers": 2})).to(device)
        return model, model
    import transformers

    if name == "gpt2":
        config: Any = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=256)
    else:
        config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                          max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    if ckpt:
        model.gradient_checkpointing_enable()
    return model, lambda ids: model(input_ids=ids, labels=ids).loss


def main() -> None:
    global BUG
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="block", choices=("block", "gpt2", "llama"))
    parser.add_argument("--optimizer", default="fused", choices=("fused", "foreach", "for-loop"))
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--bug", default="", choices=("", "saved", "weight"))
    parser.add_argument("--sync-check", action="store_true", help="steps after the first under sync debug 'error'")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    opts = parser.parse_args()
    BUG = opts.bug
    torch.manual_seed(0)
    device = opts.device
    on_cuda = device == "cuda"
    model, loss_of = build(opts.model, opts.checkpoint, device)
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[opts.optimizer]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kind)
    ids = torch.randint(0, 1024, (8, 128) if on_cuda else (2, 16), device=device, generator=torch.Generator(device).manual_seed(1))

    def step() -> torch.Tensor:
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=opts.bf16):
            loss = loss_of(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync_error = ""
    times = []
    losses = []
    for i in range(opts.steps):
        if BUG == "weight" and i == 2:
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)  # BUG: weight
        if on_cuda:
            torch.cuda.synchronize()
        if opts.sync_check and on_cuda and i >= 2:
            torch.cuda.set_sync_debug_mode("error")
        start = time.perf_counter()
        try:
            losses.append(step())
        except RuntimeError as exc:
            if "synchroniz" not in str(exc):
                raise
            sync_error = sync_error or str(exc).splitlines()[0]
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode("default")
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    warm = times[2:] or times
    print("result: " + json.dumps({
        "step_ms": statistics.median(warm) * 1e3, "losses": [float(x) for x in losses], "sync_error": sync_error,
        "params": sum(1 for _ in model.parameters())}), flush=True)


if __name__ == "__main__":
    main()
