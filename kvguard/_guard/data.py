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

import functools
import os
import threading
from typing import Any, Callable, Collection, Literal, Optional

from kvguard._guard.guard import Guard
from kvguard._report.tally import DATA_LABEL

_MARK = "__kvguard_data__"
_active: list[DataGuard] = []  # the data guards entered now, in any thread
_undo: list[Callable[[], None]] = []  # the wrapped methods' undo, while any guard is active
_lock = threading.Lock()


class DataGuard(Guard):
    """A guard over every tensor a dataset returns while it is active. Use `guard_data()`."""

    def __init__(self, *, name: Optional[str] = None, action: Optional[str] = "raise",
                 allow: Optional[Collection[str]] = None, report_dir: Optional[str | os.PathLike[str]] = None,
                 target: Optional[str] = None) -> None:
        super().__init__([], name=name or DATA_LABEL, action=action, allow=allow, report_dir=report_dir,
                         target=target, level="full", fingerprint=False)
        self._account.label = DATA_LABEL  # counted as `data`, from code or KVGUARD_TARGETS

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

    def worker_line(self, worker: int) -> str:
        """What this guard found in a DataLoader worker process, said as the worker ends (a
        multiprocessing child exits with no atexit, so the process summary never runs there)."""
        from kvguard._text import plural

        protected = self._protected.protected_count if self._protected is not None else self.protected_count
        writes = len(self.report.events) + self.report.cut
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

    seen: set[type] = set()
    todo = list(Dataset.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            _wrap_class(cls)
            todo += cls.__subclasses__()
    original = Dataset.__dict__.get("__init_subclass__")

    def __init_subclass__(cls: Any, /, **kwargs: Any) -> None:
        super(Dataset, cls).__init_subclass__(**kwargs)
        if _active:
            _wrap_class(cls)

    Dataset.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment,method-assign]

    def restore() -> None:
        if original is None:
            del Dataset.__init_subclass__
        else:
            Dataset.__init_subclass__ = original  # type: ignore[method-assign]
    _undo.append(restore)


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


_worker_said: list[int] = []  # the process id that registered its worker line (a fork copies the list)


def _said_in_worker() -> None:
    """In a DataLoader worker, have each data guard say what it found when the worker ends."""
    if _worker_said and _worker_said[0] == os.getpid():
        return
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return
    _worker_said[:] = [os.getpid()]
    import multiprocessing.util

    from kvguard._text import say

    def say_lines(guards: list[DataGuard] = list(_active), worker: int = info.id) -> None:
        for guard in guards:
            say(guard.worker_line(worker))
    multiprocessing.util.Finalize(None, say_lines, exitpriority=0)


def _wrapper(method: Any, many: bool) -> Any:
    code = getattr(method, "__code__", None)
    placed = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code is not None else None

    @functools.wraps(method)
    def wrapper(self: Any, index: Any, *args: Any, **kwargs: Any) -> Any:
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
    _said_in_worker()
    for guard in list(_active):
        for i, sample in pairs:
            try:
                guard.returned(sample_path(dataset, i), sample, placed)
            except Exception:  # noqa: BLE001 - never fail the user's data loading
                pass
