"""Asynchronous collectives' writes to protected memory, reported once they have completed.

An in-place collective (`all_reduce(t, async_op=True)`, and the backend's own work under a
synchronous call) writes when the backend gets to it, not when the op returns: what a
report reads then may be the values before. The judge defers such a report here; it is
made at the collective's `wait()` (heard through `kvguard._torch.patches.on_work_wait`), or
at the judge's next boundary (`settle_collectives`), saying the values may still have been
pending then.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch

from kvguard._torch import patches as _patches
from kvguard._torch.tensors import storage_address


class _Collective:
    """An asynchronous collective's write to protected memory, reported once it has completed."""

    __slots__ = ("judge", "storages", "report")

    def __init__(self, judge: object, storages: frozenset[int], report: Callable[[str], None]) -> None:
        self.judge, self.storages, self.report = judge, storages, report


_collectives: list[_Collective] = []
_collectives_lock = threading.Lock()
_unhook_wait: list[Callable[[], None]] = []  # the `Work.wait()` listener's undo, while one is installed


def defer(judge: object, written: Sequence[torch.Tensor], report: Callable[[str], None]) -> None:
    with _collectives_lock:
        _collectives.append(_Collective(judge, frozenset(storage_address(t) for t in written), report))
        if not _unhook_wait:
            _unhook_wait.append(_patches.on_work_wait(_on_wait))


def take(which: Callable[[_Collective], bool]) -> list[_Collective]:
    with _collectives_lock:
        taken = [p for p in _collectives if which(p)]
        _collectives[:] = [p for p in _collectives if not which(p)]
        if not _collectives and _unhook_wait:
            _unhook_wait.pop()()
    return taken


def _on_wait(outputs: Optional[list[torch.Tensor]]) -> None:
    """A collective completed (its `wait()` returned): report the writes it made to protected memory
    (those into the storages it wrote; every pending one where the backend does not say which)."""
    done = None if outputs is None else {storage_address(t) for t in outputs}
    for pending in take(lambda p: done is None or bool(p.storages & done)):
        pending.report("")
