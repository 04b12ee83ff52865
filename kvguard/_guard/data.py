"""`guard_data()`: what a dataset returned stays as it was returned.

A `Guard` whose protected set is `kvguard._protect.samples.SampleSet`. While one is
active, `__getitem__` and `__getitems__` of every `torch.utils.data.Dataset` subclass (those
defined later too) are wrapped: what they return is protected from that moment, for as
long as it lives, and an in-place write to it afterwards (by the dataset itself on a later
index, a collate function, a transform or the training loop) is reported at its line with
the dataset's class and index. Writes inside `__getitem__` to the tensor it is building are
its own: that tensor is protected only once returned. `IterableDataset`s have no index and
are not covered.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Collection, Literal, Optional

from kvguard._guard.guard import Guard
from kvguard._kinds import DATA

if TYPE_CHECKING:
    from kvguard._protect.samples import SampleSet

_MARK = "__kvguard_data__"
_active: list[DataGuard] = []  # the data guards entered now, in any thread
_undo: list[Callable[[], None]] = []  # the wrapped methods' undo, while any guard is active
_lock = threading.Lock()


class DataGuard(Guard):
    """A guard over every tensor a dataset returns while it is active. Use `guard_data()`."""

    kind = DATA
    _protected: Optional[SampleSet]

    def __init__(self, *, name: Optional[str] = None, action: Optional[str] = "raise",
                 allow: Optional[Collection[str]] = None, report_dir: Optional[str | os.PathLike[str]] = None,
                 target: Optional[str] = None) -> None:
        super().__init__([], name=name or DATA.word, action=action, allow=allow, report_dir=report_dir,
                         target=target, level="full", fingerprint=False)
        self._events_before = 0  # in a forked DataLoader worker: the events the parent's copy had

    def _new_protected(self) -> Any:
        from kvguard._protect.samples import SampleSet

        return SampleSet(self.name)

    def __enter__(self) -> DataGuard:
        super().__enter__()
        with _lock:
            if not _active:
                _wrap_all()
            _active.append(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if self._entered and self._protected is None:
            return False  # left already, as its DataLoader worker ended (`_end_worker`)
        with _lock:
            if self in _active:
                _active.remove(self)
            if not _active:
                while _undo:
                    _undo.pop()()
        return super().__exit__(exc_type, exc, tb)

    def returned(self, path: str, sample: Any, placed: Optional[str]) -> None:
        protected = self._protected
        if protected is not None and not self._paused:
            protected.returned(path, sample, placed)

    def start_in_forked_worker(self) -> None:
        """This guard is a forked DataLoader worker's copy of its parent's: from now on it counts
        as a guarded call of the worker, with what the worker's datasets return."""
        self._account.open()
        if self._protected is not None:
            self._protected.protected_count = self._protected.samples = 0
        self._events_before = len(self.report.events) + self.report.cut
        if self._clock is not None:  # no optimizer steps here: the sampled tier checks everything a worker loads
            self._unfollow()
            self._clock = None
            self.sample_in()

    def worker_line(self, worker: int) -> str:
        """What this guard found in a DataLoader worker process, said as the worker ends (a
        multiprocessing child exits with no atexit, so the process summary never runs there)."""
        from kvguard._text import plural

        protected = self._protected.protected_count if self._protected is not None else self.protected_count
        writes = len(self.report.events) + self.report.cut - self._events_before
        found = f"{plural(writes, 'write')} reported above" if writes else "no in-place writes"
        return (f"kvguard [DataLoader worker {worker}]: {self.name}: {plural(protected, 'tensor')} returned by "
                f"datasets protected, {found}")

    def _warn_if_blind(self) -> None:
        """A data guard over a block where no dataset returned anything has nothing to say."""


def guard_data(*, action: str = "raise", name: Optional[str] = None, allow: Optional[Collection[str]] = None,
               report_dir: Optional[str | os.PathLike[str]] = None) -> DataGuard:
    """Protect every tensor a `torch.utils.data.Dataset` returns while the `with` block runs.

    From the moment `__getitem__` (or `__getitems__`) returns it, for as long as it is
    alive, an in-place write to a returned tensor is reported at the writing line, like any
    kvguard event: its path names the dataset's class, the index and the place in the
    sample (`GPTDataset[3]['loss_mask']`), `placed_at` the dataset's `__getitem__`. Under
    "raise" it is stopped before the write. This is the bug of a dataset that caches or
    reuses tensors and writes them after handing them out (Megatron-LM !4164).

    Args:
        action: "raise", "warn" or "record", as for `kvguard.guard`.
        name: how reports name the guard; default "data".
        allow: paths whose writes are intended (`"GPTDataset[*]['loss_mask']"` style
            patterns, as reports print them).
        report_dir: write report files here; default: none (`KVGUARD_REPORT_DIR`).

    Example::

        with kvguard.guard_data(action="raise"):
            for batch in loader:
                train_step(batch)
    """
    return DataGuard(action=action, name=name, allow=allow, report_dir=report_dir)


def _wrap_all() -> None:
    """Wrap every Dataset subclass's `__getitem__`/`__getitems__`, and those of classes defined from now on."""
    from torch.utils.data import Dataset

    from kvguard._torch.patches import on_every_subclass

    _undo.append(on_every_subclass(Dataset, _wrap_class, later=_wrap_if_active))
    _wrap_loader()


def _wrap_if_active(cls: type) -> None:
    """A Dataset subclass defined now is wrapped while a data guard is active."""
    if _active:
        _wrap_class(cls)


def _wrap_loader() -> None:
    """Note the DataLoader iterators that start worker processes, to end their workers at exit."""
    from torch.utils.data import DataLoader

    method = DataLoader.__dict__.get("__iter__")
    if method is None or getattr(method, _MARK, False):
        return

    @functools.wraps(method)
    def __iter__(self: Any) -> Any:
        iterator = method(self)
        if _active and isinstance(getattr(self, "num_workers", 0), int) and self.num_workers > 0:
            _end_workers_at_exit(iterator)
        return iterator
    setattr(__iter__, _MARK, True)
    DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
    _undo.append(functools.partial(_restore, DataLoader, "__iter__", method, __iter__))


# DataLoader iterators with worker processes made while a data guard was active, and the process
# that registered `_end_workers` at exit (a forked child inherits both).
_iterators: weakref.WeakSet[Any] = weakref.WeakSet()
_ending: list[int] = []


def _end_workers_at_exit(iterator: Any) -> None:
    try:
        _iterators.add(iterator)
    except TypeError:  # an iterator without weak references: left to torch
        return
    if _ending != [os.getpid()]:
        _ending[:] = [os.getpid()]
        # Registered now, after torch's and multiprocessing's own exit functions: it runs before them.
        atexit.register(_end_workers)


def _end_workers() -> None:
    """At exit: end the worker processes of the DataLoader iterators still alive, as deleting the
    iterator would, so that each worker leaves its loop, says what it found and writes its summary.

    Without this, persistent workers (and those of an iterator still held) are not shut down at
    exit: torch skips it once the interpreter exits, and `multiprocessing` then terminates them
    as daemonic children, before any of their exit functions ran.
    """
    if _ending != [os.getpid()]:
        return
    from kvguard._torch import training as _training

    for iterator in list(_iterators):
        try:
            _training.end_dataloader_workers(iterator)
        except Exception:  # noqa: BLE001 - at exit: torch's own shutdown still follows
            pass


def _wrap_class(cls: type) -> None:
    for attr, many in (("__getitem__", False), ("__getitems__", True)):
        method = cls.__dict__.get(attr)
        if method is None or not callable(method) or getattr(method, _MARK, False):
            continue
        wrapper = _wrapper(method, many)
        setattr(cls, attr, wrapper)
        _undo.append(functools.partial(_restore, cls, attr, method, wrapper))


def _restore(cls: type, attr: str, method: Any, wrapper: Any) -> None:
    if cls.__dict__.get(attr) is wrapper:
        setattr(cls, attr, method)


_worker: list[tuple[int, list[DataGuard]]] = []  # (process id, its data guards) once a DataLoader worker began


def in_worker() -> bool:
    """Whether this process is a DataLoader worker whose data guards say what they found as it ends."""
    return bool(_worker) and _worker[0][0] == os.getpid()


def _start_worker() -> None:
    """In a DataLoader worker, before its first sample is loaded: make it a process of its own in the
    counts (a forked one starts with its parent's), and have each data guard leave, say what it
    found and write the worker's summary record when the worker ends."""
    if _worker and _worker[0][0] == os.getpid():
        return
    info = _worker_info()
    if info is None:
        return
    from kvguard._report import files

    guards = list(_active)
    _worker[:] = [(os.getpid(), guards)]
    if files.start_over_in_child():  # forked: the guards are the parent's copies
        for guard in guards:
            guard.start_in_forked_worker()
    import multiprocessing.util

    # Run by the worker's exit (`multiprocessing`'s own exit function, which a forked child
    # runs before `os._exit`), after its loop ended: when its DataLoader shut it down.
    multiprocessing.util.Finalize(None, _end_worker, args=(guards, info.id), exitpriority=0)


def _worker_info() -> Any:
    """`torch.utils.data.get_worker_info()`: None outside a DataLoader worker."""
    from torch.utils.data import get_worker_info

    return get_worker_info()


def _end_worker(guards: list[DataGuard], worker: int) -> None:
    """The worker ends: leave its data guards (their counts go into the tallies), say each one's
    line, and write its summary record (without the settings' diagnostics: the process that
    runs the targets says those)."""
    from kvguard._report.events import MutationError
    from kvguard._report import files
    from kvguard._text import say

    if not _worker or _worker[0][0] != os.getpid():
        return
    for guard in guards:
        try:
            guard.__exit__(None, None, None)
        except MutationError as exc:
            say(f"kvguard: {exc.args[0].splitlines()[0]}")
        except Exception as exc:  # noqa: BLE001 - at a worker's exit: one line, never a traceback
            say(f"kvguard: data guard: {exc}")
        say(guard.worker_line(worker))
    files.finish_all(diagnose=False)


def _wrapper(method: Any, many: bool) -> Any:
    code = getattr(method, "__code__", None)
    placed = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code is not None else None

    @functools.wraps(method)
    def wrapper(self: Any, index: Any, *args: Any, **kwargs: Any) -> Any:
        if _active:
            _start_worker()  # before the method runs: a forked worker's first writes are its own
        out = method(self, index, *args, **kwargs)
        if _active:
            _protect(self, index, out, many, placed)
        return out
    setattr(wrapper, _MARK, True)
    return wrapper


def _protect(dataset: Any, index: Any, out: Any, many: bool, placed: Optional[str]) -> None:
    from kvguard._protect.samples import sample_path

    try:
        pairs = list(zip(index, out)) if many else [(index, out)]
    except TypeError:  # `__getitems__` of something that is not a batch: name it as one sample
        pairs = [(index, out)]
    for guard in list(_active):
        for i, sample in pairs:
            try:
                guard.returned(sample_path(dataset, i), sample, placed)
            except Exception:  # noqa: BLE001 - never fail the user's data loading
                pass
