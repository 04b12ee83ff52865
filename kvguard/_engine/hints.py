"""The `hint` line of a stopped write: the fix, for this guard's kind, this op and this line."""

from __future__ import annotations

import ast
import sys
from typing import Any, Optional

import torch

from kvguard._protect import frames as _frames
from kvguard._torch import ops as _ops

OPTIMIZER_HINT = ("this write is an optimizer's step(): pass the optimizer, kvguard.guard_module(model, "
                  "optimizer=opt), and its steps are the writes meant")
GENERAL_HINT = "write to a new tensor or clone first (k = k.clone())"
WEIGHTS_HINT = ("the weights change outside an optimizer's step() here; if that is meant (a weight sync, an EMA, "
                "a re-initialisation), say so with kvguard.allow('why') around it")


def hint(func: Any, code: str = "", weights: bool = False) -> str:
    """The `hint` line of a stopped write: the fix for this guard's kind, this op and this line.

    A model's weights are written by their optimizer's step (say which with `optimizer=`)
    or on purpose (`kvguard.allow`). Other data is written to a new tensor: the user's own
    `k *= c` rewritten as `k = k * c`, else the op's out-of-place twin when the schema's
    name has one (`masked_fill_` -> `masked_fill`), derived rather than listed.
    """
    if weights:
        return OPTIMIZER_HINT if _in_optimizer_step() else WEIGHTS_HINT
    rewritten = _out_of_place(code)
    if rewritten is not None:
        return f"write to a new tensor ({rewritten[1]}) or clone first ({rewritten[0]} = {rewritten[0]}.clone())"
    name, _, overload = str(func).removeprefix("aten.").partition(".")
    twin = name[:-1] if name.endswith("_") and not name.endswith("__") else ""
    if overload == "out" or overload.endswith("_out"):  # `torch.add(a, b, out=k)`: drop out=
        return f"write to a new tensor (k = torch.{name}(...) without out=) or clone first (k = k.clone())"
    if twin and not twin.startswith("_") and callable(getattr(torch.Tensor, twin, None)):
        given = "()" if _ops.argument_count(func) == 1 else "(...)"  # `relu_(self)`: nothing to pass
        return f"write to a new tensor (k = k.{twin}{given}) or clone first (k = k.clone())"
    return GENERAL_HINT


def _out_of_place(code: str) -> Optional[tuple[str, str]]:
    """(`k`, `k = k * c`) for a line `k *= c` (or `self.k *= c`); None for any other line."""
    try:
        (statement,) = ast.parse(code.strip()).body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(statement, ast.AugAssign) or isinstance(statement.target, ast.Subscript):
        return None  # `k[i] += c` rebound is still a write into k
    target = statement.target
    assign = ast.Assign(targets=[target], value=ast.BinOp(target, statement.op, statement.value), lineno=1)
    return ast.unparse(target), ast.unparse(assign)


def _in_optimizer_step() -> bool:
    """Whether the write runs inside an optimizer's `step()` (a frame `step` of a `torch.optim.Optimizer`)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "step" and isinstance(_frames.frame_names(frame, ("self",)).get("self"),
                                                         torch.optim.Optimizer):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
