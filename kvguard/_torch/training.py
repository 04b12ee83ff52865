"""Torch's training objects, where kvguard must know their private shape: which modules update
their own buffers, what a `Module._apply` function does to values, and how a DataLoader
iterator's workers are ended.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

_MODULE_FILE = torch.nn.modules.module.__file__
# Module's methods whose `_apply` changes dtype or device (or shares memory), never values.
_CONVERSIONS = frozenset({"to", "cuda", "cpu", "xpu", "ipu", "mtia", "type", "float", "double", "half",
                          "bfloat16", "share_memory"})


def updates_own_buffers(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward (or a forward hook of torch's on it) updates its own buffers in
    training: batch norm and instance norm with running statistics, the classic spectral norm's
    `weight_u`/`weight_v`, the parametrized spectral norm's `_u`/`_v`, quantization observers."""
    classes, hook_class = _self_updating()
    if isinstance(module, classes):
        return True
    hooks = getattr(module, "_forward_pre_hooks", None) or {}
    return any(isinstance(hook, hook_class) for hook in hooks.values())


@functools.lru_cache(maxsize=None)
def _self_updating() -> tuple[tuple[type, ...], type]:
    from torch.ao.quantization import FakeQuantizeBase, ObserverBase
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    return (_NormBase, _SpectralNorm, ObserverBase, FakeQuantizeBase), SpectralNorm


def module_apply_kind(fn: object) -> Literal["conversion", "empty", "other"]:
    """What `Module._apply(fn)` does to values: "conversion" (one of Module's own dtype or device
    conversions: `to`, `half`, `cpu`...), "empty" (`to_empty`: uninitialised memory), or
    "other" (anything else: a caller's own function, whose values must be compared)."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_filename != _MODULE_FILE:
        return "other"
    parts = getattr(fn, "__qualname__", "").split(".")
    if len(parts) < 3 or parts[0] != "Module" or parts[2] != "<locals>":
        return "other"
    return "conversion" if parts[1] in _CONVERSIONS else "empty" if parts[1] == "to_empty" else "other"


def end_dataloader_workers(iterator: object) -> None:
    """End a DataLoader iterator's worker processes as deleting it does: each worker leaves its
    loop and exits normally (its exit functions run). Nothing for an iterator without workers,
    or one shut down already."""
    shut_down = getattr(iterator, "_shutdown_workers", None)
    if callable(shut_down):
        shut_down()
