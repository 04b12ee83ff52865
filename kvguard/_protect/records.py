"""What the protected set records of each tensor: its memory, a layout token, a digest.

Taken for a whole batch when a guard starts protecting tensors, and again at its
boundaries to compare. With the compiled extension loaded (`write_hook.describe`), a
plain strided tensor costs a few metadata reads in C++ and its digest one pass over its
bytes, for the whole batch in one call; subclasses, sparse, nested and meta tensors, and
every tensor without the extension, are read in Python through torch's API. Both build
the one `Record` type, field for field; only the layout token differs in kind (an int from
C++, a tuple from Python), and a set keeps to one source for its whole life.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Hashable, Iterable, NamedTuple, Optional, Sequence, cast

import torch

from kvguard._native.build import MODULE_NAME
from kvguard._protect import digest as _digest
from kvguard._protect import geometry as _geometry
from kvguard._torch import tensors as _tensors


class Record(NamedTuple):
    """One tensor as the protected set keeps it, built alike by C++ and by Python.

    The compiled hook is handed this type once (`bind`) and builds its records as it, with
    no Python call per record; it checks the field order against its own `RECORD_FIELDS`
    (csrc/describe.h's `kRecordFields`), the one place besides this one that names them.
    """

    layout: Hashable  # changes when the tensor is re-pointed or reshaped (C++: an int; Python: a tuple)
    impl: Optional[int]  # its TensorImpl address (`_cdata`); None: it has none
    # The one span C++ read: its device, [start, stop) the bytes the elements span ((0, 0): none),
    # `dense` whether they tile it. Read in Python: device None, (0, 0), dense None, and `spans`.
    device: Optional[torch.device]
    start: int
    stop: int
    dense: Optional[bool]
    digest: _digest.Digest  # its values' digest (None: none)
    # An inference tensor, whose writes inside `torch.inference_mode()` only the write hooks'
    # inference-mode kernels see (`kvguard._engine.hooks`).
    inference: bool
    spans: Optional[list[_geometry.Span]]  # read in Python: every span (`_geometry.spans`); None from C++


# The positions of the fields, for code that indexes a record in a hot loop.
LAYOUT, IMPL, DEVICE, START, STOP, DENSE, DIGEST, INFERENCE, SPANS = range(len(Record._fields))
_new_record = tuple.__new__  # `_new_record(Record, values)`: a record without NamedTuple's Python `__new__`
_bound: Optional[ModuleType] = None  # the compiled hook that builds its records as `Record`


def bind(module: ModuleType) -> ModuleType:
    """Hand `Record` to the compiled hook `module` (once): its records are built as it from now on."""
    global _bound
    if module is not _bound:
        module.set_record_type(Record)
        _bound = module
    return module


def compiled_describe() -> Optional[ModuleType]:
    """The compiled extension, if this process has loaded it (never builds it), bound to `Record`."""
    module = sys.modules.get(MODULE_NAME)
    if module is None or not hasattr(module, "describe"):
        return None
    return module if module is _bound else bind(module)


def describe(tensors: Sequence[torch.Tensor], digest: bool, compiled: Optional[ModuleType]) -> list[Record]:
    """A record of each tensor (alive: the caller holds them). Never raises."""
    found: list[Optional[Record]] = [None] * len(tensors)
    if compiled is not None:
        try:
            found = (compiled if compiled is _bound else bind(compiled)).describe(list(tensors), _tensors.PLAIN, digest)
        except Exception:  # noqa: BLE001 - Python reads them all instead
            found = [None] * len(tensors)
    python: list[int] = []  # what C++ left to Python
    pending: list[int] = []  # digests Python takes: other devices, and what C++ left to it
    for i, record in enumerate(found):
        if record is None:
            python.append(i)
            if digest:
                pending.append(i)
        elif record.digest is NotImplemented:
            pending.append(i)
    digests = dict(zip(pending, _digest.digests([tensors[i] for i in pending]))) if pending else {}
    new, fingerprint, spans_of, value = _new_record, _tensors.storage_fingerprint, _geometry.spans, digests.get
    for i in python:
        tensor = tensors[i]
        found[i] = new(Record, (fingerprint(tensor), _impl(tensor), None, 0, 0, None, value(i),
                                _is_inference(tensor), spans_of(tensor)))
    for i in pending:
        record = found[i]
        if record is not None and record.spans is None:  # C++'s, its digest left to Python
            found[i] = record._replace(digest=digests[i])
    return cast("list[Record]", found)  # every None was replaced above


def spans(record: Record) -> list[_geometry.Span]:
    """The byte spans of a record's tensor, as `_geometry.spans` gives them."""
    if record.spans is not None:
        return record.spans
    device = record.device
    return [_geometry.Span(device, record.start, record.stop, record.dense)] if record.stop and device is not None else []


def has_memory(record: Record) -> bool:
    """Whether a record's tensor has element bytes (else writes to it are matched by identity)."""
    return bool(record.spans) if record.spans is not None else record.stop != 0


def intervals(records: Iterable[Record]) -> list[tuple[int, int]]:
    """The `[start, stop)` byte ranges of the records' tensors (all devices together), unsorted.

    Only real memory: a meta tensor's spans are offsets in its storage (`_geometry.spans`).
    """
    found = []
    for record in records:
        if record.spans is None:
            if record.stop:
                found.append((record.start, record.stop))
        else:
            found += [(span.start, span.stop) for span in record.spans if isinstance(span.device, torch.device)]
    return found


def impls(records: Iterable[Record]) -> list[int]:
    """The TensorImpl addresses of the records' tensors (those that have one)."""
    return [impl for record in records if (impl := record.impl) is not None]


def holds_inference(records: Iterable[Record]) -> bool:
    """Whether one of the records' tensors is an inference tensor."""
    return any(record.inference for record in records)


def layout_text(record: Record) -> str:
    """How a report shows a record's memory and layout."""
    if record.spans is None:
        return f"elements at {record.start:#x}..{record.stop:#x} on {record.device}" if record.stop else (
            f"no element memory on {record.device}")
    return _fingerprint_text(record.layout)


def tensor_text(tensor: torch.Tensor) -> str:
    """How a report shows a live tensor's memory and layout (read in Python, fully)."""
    return _fingerprint_text(_tensors.storage_fingerprint(tensor))


def _fingerprint_text(fp: Hashable) -> str:
    """A `_tensors.storage_fingerprint` as a report shows it."""
    if isinstance(fp, tuple) and len(fp) >= 5:
        return f"data_ptr {fp[1]:#x}, shape {tuple(fp[2])}, stride {fp[3]}, offset {fp[4]}"
    return repr(fp[1:]) if isinstance(fp, tuple) and len(fp) > 1 else "unknown"


def _is_inference(tensor: torch.Tensor) -> bool:
    try:
        return bool(tensor.is_inference())
    except Exception:  # noqa: BLE001 - a subclass that refuses it: none of its writes bypass the hook
        return False


def _impl(tensor: torch.Tensor) -> Optional[int]:
    try:
        return _tensors.identity(tensor)
    except Exception:  # noqa: BLE001 - a subclass without one: found by its memory
        return None
