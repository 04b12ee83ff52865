"""What the protected set records of each tensor: its memory, a layout token, a digest.

Taken for a whole batch when a guard starts protecting tensors, and again at its
boundaries to compare. With the compiled extension loaded (`write_hook.describe`), a
plain strided tensor costs a few metadata reads in C++ and its digest one pass over its
bytes, for the whole batch in one call; subclasses, sparse, nested and meta tensors, and
every tensor without the extension, are read in Python through torch's API. Both give
the same spans and digests; only the layout token differs in kind (an int from C++, a
tuple from Python), and a set keeps to one source for its whole life.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Iterable, Optional, Sequence

import torch

from kvguard import _torch
from kvguard._native.build import MODULE_NAME
from kvguard._protect import digest as _digest

# A record: (layout, impl, device, start, stop, dense, digest, inference). `layout` changes when the
# tensor is re-pointed or reshaped; `impl` is its TensorImpl address (`_cdata`, None if it
# has none). From C++: `device` is a torch.device and [start, stop) the bytes its elements
# span ((0, 0): none), `dense` whether they tile it. From Python: `device` is None and
# `start` holds the spans (`_torch.spans`). `digest` is its values' digest (None: none).
# `inference`: an inference tensor, whose writes inside `torch.inference_mode()` only the
# write hooks' inference-mode kernels see (`kvguard._engine.hooks`).
Record = tuple[Any, ...]
LAYOUT, IMPL, DEVICE, START, STOP, DENSE, DIGEST, INFERENCE = range(8)


def compiled_describe() -> Optional[ModuleType]:
    """The compiled extension, if this process has loaded it (never builds it)."""
    module = sys.modules.get(MODULE_NAME)
    return module if module is not None and hasattr(module, "describe") else None


def describe(tensors: Sequence[torch.Tensor], digest: bool, compiled: Optional[ModuleType]) -> list[Record]:
    """A record of each tensor (alive: the caller holds them). Never raises."""
    found: list[Any] = [None] * len(tensors)
    if compiled is not None:
        try:
            found = compiled.describe(list(tensors), _torch.PLAIN, digest)
        except Exception:  # noqa: BLE001 - Python reads them all instead
            found = [None] * len(tensors)
    pending: list[int] = []  # digests Python takes: other devices, and what C++ left to it
    for i, record in enumerate(found):
        if record is None:
            tensor = tensors[i]
            found[i] = (_torch.storage_fingerprint(tensor), _impl(tensor), None, _torch.spans(tensor), None,
                        None, None, _is_inference(tensor))
            if digest:
                pending.append(i)
        elif record[DIGEST] is NotImplemented:
            pending.append(i)
    if pending:
        for i, value in zip(pending, _digest.digests([tensors[i] for i in pending])):
            found[i] = found[i][:DIGEST] + (value,) + found[i][DIGEST + 1:]
    return found


def spans(record: Record) -> list[_torch.Span]:
    """The byte spans of a record's tensor, as `_torch.spans` gives them."""
    if record[DEVICE] is None:
        found: list[_torch.Span] = record[START]
        return found
    return [_torch.Span(record[DEVICE], record[START], record[STOP], record[DENSE])] if record[STOP] else []


def has_memory(record: Record) -> bool:
    """Whether a record's tensor has element bytes (else writes to it are matched by identity)."""
    return bool(record[START]) if record[DEVICE] is None else record[STOP] != 0


def intervals(records: Iterable[Record]) -> list[tuple[int, int]]:
    """The `[start, stop)` byte ranges of the records' tensors (all devices together), unsorted.

    Only real memory: a meta tensor's spans are offsets in its storage (`_torch.spans`).
    """
    found = []
    for record in records:
        if record[DEVICE] is not None:
            if record[STOP]:
                found.append((record[START], record[STOP]))
        else:
            found += [(span.start, span.stop) for span in record[START] if isinstance(span.device, torch.device)]
    return found


def impls(records: Iterable[Record]) -> list[int]:
    """The TensorImpl addresses of the records' tensors (those that have one)."""
    return [impl for record in records if (impl := record[IMPL]) is not None]


def holds_inference(records: Iterable[Record]) -> bool:
    """Whether one of the records' tensors is an inference tensor."""
    return any(record[INFERENCE] for record in records)


def layout_text(record: Record) -> str:
    """How a report shows a record's memory and layout."""
    if record[DEVICE] is not None:
        return f"elements at {record[START]:#x}..{record[STOP]:#x} on {record[DEVICE]}" if record[STOP] else (
            f"no element memory on {record[DEVICE]}")
    return _fingerprint_text(record[LAYOUT])


def tensor_text(tensor: torch.Tensor) -> str:
    """How a report shows a live tensor's memory and layout (read in Python, fully)."""
    return _fingerprint_text(_torch.storage_fingerprint(tensor))


def _fingerprint_text(fp: Any) -> str:
    """A `_torch.storage_fingerprint` as a report shows it."""
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
        return _torch.identity(tensor)
    except Exception:  # noqa: BLE001 - a subclass without one: found by its memory
        return None
