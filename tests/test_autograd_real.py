"""`guard_autograd` on a real transformers model with gradient checkpointing (slow: imports transformers).

A tiny Llama (and a Qwen2-MoE) built from a config (no download), `gradient_checkpointing_enable()`
(`activation_checkpointing_enable()` in 5.x; non-reentrant, transformers' default): a clean run is bitwise the run without kvguard and
protects what the checkpointed layers save; a write inside a checkpointed layer is
caught at its line. Tested with transformers 5.25.0.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch

import kvguard

pytestmark = pytest.mark.slow


def _line(marker: str) -> int:
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()  # type: ignore[arg-type]
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)


@pytest.fixture()
def llama() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")

    def build(checkpointing: bool = True, kind: str = "llama") -> Any:
        torch.manual_seed(0)
        sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, use_cache=False)
        if kind == "qwen2_moe":  # a mixture of experts: routing, index_add_ into the output
            model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
                **sizes, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
        if checkpointing:  # non-reentrant by default; renamed activation_checkpointing_enable in 5.x
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        model.train()
        return model
    return build


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _steps(model: Any, n: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(n):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe"])
def test_a_checkpointed_model_trains_bitwise_the_same_and_its_layers_saves_are_protected(llama: Any,
                                                                                          kind: str) -> None:
    plain = _steps(llama(kind=kind))
    with kvguard.guard_autograd(action="raise") as g:
        guarded = _steps(llama(kind=kind))
    assert g.report.ok and g.graphs == 3
    assert all(torch.equal(a, b) for a, b in zip(plain[0], guarded[0]))
    assert all(torch.equal(a, b) for a, b in zip(plain[1], guarded[1]))
    with kvguard.guard_autograd(action="raise") as unchecked:
        _steps(llama(checkpointing=False, kind=kind))
    # Every tensor the layers save in the first forward is protected (before composing, only
    # the checkpoints' inputs were), and the recomputation's again during backward.
    assert g.protected_count > unchecked.protected_count


def test_a_write_inside_a_checkpointed_layer_is_caught_at_its_line(llama: Any) -> None:
    model = llama()
    down = model.model.layers[0].mlp.down_proj
    def halve_the_input(mod: Any, args: Any, out: Any) -> None:
        args[0].mul_(0.5)  # the bug: down_proj saved (a 2-D view of) its input

    down.register_forward_hook(halve_the_input)
    with pytest.raises(kvguard.MutationError) as info:
        with kvguard.guard_autograd(action="raise"):
            model(input_ids=IDS, labels=IDS).loss.backward()
    event = info.value.event
    assert event.lineno == _line("args[0].mul_(0.5)") and event.op == "aten.mul_.Tensor"
    assert event.path == "<saved by MmBackward0: self>"
