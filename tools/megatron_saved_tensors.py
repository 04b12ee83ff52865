"""What saved-tensor hooks change for megatron-core's tensor-parallel linear layers, on CPU.

Any saved-tensor hooks (kvguard's `KVGUARD_TARGETS=autograd`, PyTorch's `save_on_cpu`, an
identity pair) make autograd wrap what the unpack hook returns in a new tensor: in a
custom Function's backward, `ctx.saved_tensors` gives new objects, not the Parameter
saved, without its class and Python attributes. megatron-core's
`LinearWithGradAccumulationAndAsyncCommunication.backward` (ColumnParallelLinear and
RowParallelLinear) reads `hasattr(weight, "grad_added_to_main_grad")` on the weight it
saved when gradient accumulation fusion is on. This script trains real megatron-core
layers (world size 1, gloo) under Megatron's own DistributedDataParallel, with fusion off
and on, plain and under each kind of hooks, and prints what differs.

Fusion needs Apex's `fused_weight_gradient_mlp_cuda` and Megatron's DDP allocates on
`torch.cuda.current_device()`: on CPU both get stand-ins (`main_grad += grad_output^T @
input`, the kernel's documented effect; the current device is the CPU). Nothing else of
megatron-core is changed.

    python tools/megatron_saved_tensors.py      # needs megatron-core 0.16 (the ci extra)
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist


def _stand_ins() -> None:
    from megatron.core.tensor_parallel import layers

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]

    def accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.add_(grad_output.t().matmul(total_input))

    layers.fused_weight_gradient_mlp_cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        wgrad_gemm_accum_fp32=accum, wgrad_gemm_accum_fp16=accum)
    layers._grad_accum_fusion_available = True


class Probe:
    """Wraps megatron's Function backward to see what `ctx.saved_tensors` gives."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from megatron.core.tensor_parallel.layers import (
            LinearWithGradAccumulationAndAsyncCommunication as F,
        )

        original = F.backward

        def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
            _, weight = ctx.saved_tensors
            self.seen.append({"class": type(weight).__name__,
                              "has_flag": hasattr(weight, "grad_added_to_main_grad"),
                              "attrs": sorted(k for k in getattr(weight, "__dict__", {}) if not k.startswith("_"))})
            return original.__wrapped__(ctx, grad_output) if hasattr(original, "__wrapped__") else original(
                ctx, grad_output)

        F.backward = staticmethod(backward)  # type: ignore[assignment]
        try:
            yield
        finally:
            F.backward = original  # type: ignore[method-assign]


def run(fusion: bool, overlap: bool, hooks: str) -> dict[str, Any]:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                               gradient_accumulation_fusion=fusion)
    init = torch.nn.init.xavier_normal_

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = ColumnParallelLinear(16, 32, config=config, init_method=init, bias=True, gather_output=False)
            self.fc2 = RowParallelLinear(32, 16, config=config, init_method=init, bias=True,
                                         input_is_parallel=True, skip_bias_add=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.fc1(x)
            out, _ = self.fc2(torch.nn.functional.gelu(h))
            return out

    model = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=overlap,
                                                                          bucket_size=None), MLP())
    probe = Probe()
    x = torch.randn(8, 2, 16)
    result: dict[str, Any] = {}
    contexts: dict[str, Callable[[], Any]] = {
        "plain": contextlib.nullcontext,
        "identity hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        "save_on_cpu": torch.autograd.graph.save_on_cpu,
        "kvguard": lambda: __import__("kvguard").guard_autograd(action="raise"),
    }
    try:
        with probe.installed():
            for step in range(2):
                model.zero_grad_buffer()
                with contexts[hooks]():
                    loss = model(x).pow(2).mean()
                    loss.backward()
                model.finish_grad_sync()
        result["main_grad"] = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
        result["flag"] = {n: p.grad_added_to_main_grad for n, p in model.module.named_parameters()
                          if n.endswith("weight")}
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - what the configuration does is the finding
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    result["seen"] = probe.seen[:2]
    return result


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[1] if len(sys.argv) > 1 else "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    _stand_ins()
    for fusion, overlap in ((False, False), (False, True), (True, False), (True, True)):
        base = run(fusion, overlap, "plain")
        for hooks in ("plain", "identity hooks", "save_on_cpu", "kvguard"):
            got = base if hooks == "plain" else run(fusion, overlap, hooks)
            line = f"fusion={fusion!s:5} overlap_grad_reduce={overlap!s:5} {hooks:14}"
            if not got["ok"]:
                print(f"{line} FAILS: {got['error']}")
            else:
                same = base["ok"] and all(torch.equal(base["main_grad"][n], g) for n, g in got["main_grad"].items())
                print(f"{line} ok; main_grad bitwise equal to plain: {same}; "
                      f"weight.grad_added_to_main_grad after backward: {sorted(set(got['flag'].values()))}")
            seen = got["seen"][0] if got["seen"] else {}
            print(f"    ctx.saved_tensors weight: {seen.get('class')}, hasattr(grad_added_to_main_grad) "
                  f"{seen.get('has_flag')}, Python attributes {seen.get('attrs')}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
