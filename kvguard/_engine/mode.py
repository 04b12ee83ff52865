"""The `mode` engine: a `TorchDispatchMode` that sees every op on its thread.

The slowest engine (every op, reads included, becomes a Python call) and the one that
sees most on its thread: every inference-mode write (the write hooks see those once the
protected tensor is known to them), and inductor's compiled writes, which run eagerly
under a mode. Used where the write hook cannot be
installed (torch < 2.9) or when `KVGUARD_ENGINE=mode` asks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from kvguard._engine.judge import WriteJudge, judge_all
from kvguard._torch import dispatch as _dispatch
from kvguard._torch import ops as _ops
from kvguard._torch.dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from kvguard._torch.dispatch import ExcInfo

_facts_cache = _ops._facts_cache
_op_facts = _ops.op_facts


class MutationGuardMode(TorchDispatchMode):
    """Hands every op that writes something to a `WriteJudge`.

    Ops that write nothing cost one dict lookup on top of the dispatch itself.
    """

    def __init__(self, judge: WriteJudge) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.judge = judge
        self.ops = 0  # ops dispatched under the mode: none means the guarded code did no tensor work

    # func: an op overload (a private class, Any outside the fence); args and kwargs as torch passes them.
    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> object:
        self.ops += 1
        cached = _facts_cache.get(id(func))
        facts = cached[1] if cached is not None else _op_facts(func)
        kwargs = kwargs or {}
        if not facts.written:
            return func(*args, **kwargs)
        written: Sequence[torch.Tensor]
        if facts.self_only and args:
            written = (args[0],)
        else:
            written = _ops.written_tensors(facts, args, kwargs)
        # Modes below this one see the op next: asked only if this guard stops it.
        pending = judge_all((self.judge,), func, facts, written, args, more=thread_judges,
                            read=lambda: _ops.shared_reads(facts, args, kwargs, written))
        if not pending:
            return func(*args, **kwargs)
        after = pending[0]
        try:
            out = func(*args, **kwargs)
        except BaseException:
            after(True)  # what it wrote before failing is still reported
            raise
        after()
        return out


def thread_judges() -> list[WriteJudge]:
    """The judges of the guards' dispatch modes on this thread, in the order ops reach them
    (inside a mode's `__torch_dispatch__`: the modes below it)."""
    return [m.judge for m in reversed(_dispatch.current_dispatch_modes()) if isinstance(m, MutationGuardMode)]


class ModeAttachment:
    """One guard's dispatch mode, on the entering thread's mode stack."""

    engine = "mode"

    def __init__(self, judge: WriteJudge) -> None:
        self.mode = MutationGuardMode(judge)
        self.mode.__enter__()  # type: ignore[no-untyped-call]

    @property
    def ops(self) -> int:
        return self.mode.ops

    def detach(self, exc_info: ExcInfo) -> None:
        """Leave the mode stack, also out of order (see `_dispatch.exit_dispatch_mode`)."""
        _dispatch.exit_dispatch_mode(self.mode, exc_info)
