"""The write-hook engines: a kernel on ADInplaceOrView for every op that writes.

Ops that write nothing never reach that dispatch key, so reads cost nothing. A writing
op's kernel (`write_hook`, compiled, or `kernels`, its Python twin) compares the
written storage with the protected memory of every active guard and enters Python only
on a possible hit, where each guard's `WriteJudge` decides. The hook is process-wide:
it sees writes from every thread, not only the one that entered the guard.

A backend is installed once, at the first guard, and then switched on and off: it is
registered from one thread, and a kernel registration is not safe against ops running
concurrently on others.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from kvguard._engine.backend import Backend
from kvguard._engine.judge import After, WriteJudge, judge_all
from kvguard._engine.mode import thread_judges
from kvguard._protect import frames as _frames
from kvguard._protect.collector import collector_paused
from kvguard._torch import ops as _ops
from kvguard._torch.compiled import outside_dynamo

if TYPE_CHECKING:
    from kvguard._protect.contract import Added
    from kvguard._torch.dispatch import ExcInfo


# op name as the backend spells it ("aten::mul_.Tensor") -> its OpOverload (a private class: Any here)
_overloads: dict[str, Any] = {}


def overload_of(name: str) -> Any:
    """`torch.ops.aten.mul_.Tensor` for `"aten::mul_.Tensor"` (cached)."""
    func = _overloads.get(name)
    if func is None:
        qualified, _, overload = name.partition(".")
        namespace, _, op = qualified.partition("::")
        func = _overloads[name] = getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
    return func


class HookEngine:
    """The active guards of one installed backend, and the protected memory they share."""

    def __init__(self, name: str, backend: Backend) -> None:
        self.name = name
        self.backend = backend
        self.judges: list[WriteJudge] = []  # in entry order: the innermost guard judges first
        self._lock = threading.RLock()
        self._threads: dict[int, int] = {}  # id(judge) -> the thread that entered its guard
        # id(judge) -> the thread whose inference-mode writes it made the backend watch
        self._inference: dict[int, int] = {}
        # Called from inside ops, also while Dynamo traces a compiled function: never traced.
        on_write, look = self._on_write, self._look

        def on_write_outside(name: str, written: Sequence[torch.Tensor],
                             read: Sequence[torch.Tensor] = ()) -> Optional[After]:
            return on_write(name, written, read)

        def look_outside() -> None:
            look()
        self._on_write = outside_dynamo(on_write_outside)  # type: ignore[method-assign]
        self._look = outside_dynamo(look_outside)  # type: ignore[method-assign]
        backend.install()

    def attach(self, judge: WriteJudge) -> HookAttachment:
        with self._lock:
            # Ops defined since the hook was installed (a custom op): hooked as themselves.
            self.backend.hook_new()
            self.judges.append(judge)
            self._threads[id(judge)] = threading.get_ident()

            def on_index(added: Added) -> None:
                self._push(added, judge)
            judge.protected.on_index = on_index
            # A set that publishes what it protects itself, as it arrives (autograd's packs), keeps the
            # backend; one that admits a known batch of writes in C++ (an optimizer step's) keeps the
            # hook, with what the other guards on it protect. The others ignore both (the contract).
            judge.protected.attach_backend(self.backend)
            judge.protected.attach_hook(self)
            try:
                if len(self.judges) == 1:
                    self.backend.set_callback(self._on_write)
                self._push(None, judge)
                self.backend.set_enabled(True)
            except BaseException:
                self.detach(judge)
                raise
        return HookAttachment(self, judge)

    def detach(self, judge: WriteJudge) -> None:
        with self._lock:
            if judge in self.judges:
                self.judges.remove(judge)
            judge.protected.on_index = None
            judge.protected.attach_backend(None)
            judge.protected.attach_hook(None)
            self._unwatch_inference(judge)
            self._threads.pop(id(judge), None)
            if not self.judges:
                self.backend.set_enabled(False)
                self.backend.set_callback(None)
                self.backend.set_watch(None)
            self._push()

    def _watch_inference(self, judge: WriteJudge, added: Added) -> None:
        """Inference tensors are written inside `torch.inference_mode()` past ADInplaceOrView:
        while `judge` protects one, its guard's thread has the backend judge those writes too.

        Only then: the other threads, and this one while no inference tensor is protected,
        pay nothing for it. A placement seen from another thread cannot switch it on for
        the guard's thread (thread-local): a boundary check sees that write.
        """
        thread = self._threads.get(id(judge))
        if id(judge) in self._inference or thread != threading.get_ident():
            return
        if judge.protected.holds_inference(added) and self.backend.watch_inference(True):
            self._inference[id(judge)] = thread

    def _unwatch_inference(self, judge: WriteJudge) -> None:
        thread = self._inference.pop(id(judge), None)
        if thread is not None and thread == threading.get_ident():  # a guard left from another
            self.backend.watch_inference(False)  # thread leaves its own watching on (costs a call per write)

    def _push(self, added: Added = None, judge: Optional[WriteJudge] = None) -> None:
        """Tell the backend what the guards protect: all of it, or only the entries `added`
        (by `judge`'s set).

        Then the watch: the containers to compare before each write, where placements show.
        """
        if judge is not None and (added is None or added):
            self._watch_inference(judge, added)
        with self._lock, collector_paused():  # lists as long as the protected set: no collection midway
            judges, backend = self.judges, self.backend
            if added is None:  # all of it: the first set replaces what was published, the others add
                backend.add_protected([], [], True)
                send_all = [other.protected.publish(backend, None, False) for other in judges]
                backend.set_send_all(any(send_all))
            elif added and judge is not None and judge.protected.publish(backend, added, False):
                backend.set_send_all(True)
            watching = [j.protected for j in judges if j.protected.watching]
            snapshots = [p.snapshot_pairs() for p in watching]
            backend.set_watch(self._look if watching else None,
                              None if any(s is None for s in snapshots) else [
                                  pair for pairs in snapshots for pair in pairs or ()])

    def look(self) -> None:
        """Protect what was placed since the last look (before a write no op dispatches)."""
        self._look()

    def _look(self) -> None:
        """Before a write is judged: protect what was placed since the last look."""
        for judge in list(self.judges):
            judge.protected.look()

    def _on_write(self, name: str, written: Sequence[torch.Tensor],
                  read: Sequence[torch.Tensor] = ()) -> Optional[After]:
        """A write that may touch protected memory; returns what to run after it, if anything.
        `read`: the arguments it only reads that share a storage with what it writes."""
        func = overload_of(name)
        facts = _ops.op_facts(func)
        if not facts.written or next(_frames.user_frames(sys._getframe(0).f_back), None) is None:
            # No Python caller: torch's own thread doing an op's work (a collective's copy at
            # its `wait()`); the op was judged where it was called, a boundary check sees the rest.
            return None
        # Innermost guard first; then the dispatch modes on this thread, which the op
        # reaches after ADInplaceOrView (asked only when a guard here stops it).
        afters = judge_all(reversed(list(self.judges)), func, facts, written, more=thread_judges, read=read)
        return _Afters(afters) if afters else None

    def writes(self) -> int:
        return int(self.backend.writes())

    def uninstall(self) -> None:
        """Remove the kernels (no guard may be attached): the originals are back."""
        with self._lock:
            assert not self.judges, "uninstalling a write hook with guards attached"
            self.backend.set_enabled(False)
            self.backend.uninstall()


class _Afters:
    """What runs once a judged write is done: each guard's `after`, the outermost guard's first.

    Called from inside the op, also while Dynamo traces or runs a compiled function: the
    frame of `__call__` is marked for Dynamo to skip, with everything it calls.
    """

    __slots__ = ("afters",)

    def __init__(self, afters: Sequence[After]) -> None:
        self.afters = afters

    def __call__(self, failed: bool = False) -> None:
        for after in reversed(self.afters):  # as with nested modes
            after(failed)


_Afters.__call__ = outside_dynamo(_Afters.__call__)  # type: ignore[method-assign]


class HookAttachment:
    """One guard's place among a hook engine's active guards."""

    def __init__(self, engine: HookEngine, judge: WriteJudge) -> None:
        self.hook = engine
        self.engine = engine.name
        self.judge = judge
        self._writes_at_entry = engine.writes()

    @property
    def ops(self) -> int:
        """Writing ops seen in the process since the guard was entered (reads are not seen)."""
        return self.hook.writes() - self._writes_at_entry

    def detach(self, exc_info: ExcInfo) -> None:
        self.hook.detach(self.judge)

