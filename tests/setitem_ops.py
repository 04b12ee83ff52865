"""The op that `t[index] = value` dispatches on the installed torch, for the tests that name it.

torch 2.15 writes a Python scalar assigned through indexing with `aten.fill_.Scalar` (a
slice) and `aten.masked_fill_.Scalar` (a boolean mask); torch 2.14 and earlier lift the
scalar to a tensor first and write with `aten.fill_.Tensor` and `aten.index_put_.default`.
kvguard reports the op that ran, so a test expects what this torch runs, asked of torch
itself here. torch 2.15's `fill_.Scalar` also no longer refuses a write over several
elements that share one memory location (an `expand`ed tensor), which 2.14's `fill_.Tensor`
refuses (`SHARED_FILL_REFUSED`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _LastWrite(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.op = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.is_mutable:
            self.op = str(func)
        return func(*args, **(kwargs or {}))


def writing_op(assign: Callable[[torch.Tensor], None]) -> str:
    """The (last) writing op `assign` dispatches on a float tensor of 4 elements: `aten.fill_.Scalar`."""
    t = torch.arange(4.0)
    with _LastWrite() as mode:
        assign(t)
    assert mode.op, "the assignment dispatched no writing op"
    return mode.op


def _shared_fill_refused() -> bool:
    try:
        torch.tensor([[1.0]]).expand(1, 3)[0, 0:2] = -5.0
    except RuntimeError:
        return True
    return False


SLICE_FILL = writing_op(lambda t: t.__setitem__(slice(1, 3), 5))  # `k[1:3] = 5`
MASK_FILL = writing_op(lambda t: t.__setitem__(t > 1, 0.0))  # `k[k > 3] = 0`
SHARED_FILL_REFUSED = _shared_fill_refused()  # `expanded[0, 1:4] = -5.0` raises RuntimeError
