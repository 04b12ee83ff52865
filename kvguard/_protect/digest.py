"""Value fingerprints: an order-sensitive digest of each protected tensor's element bytes.

Taken when a tensor enters the protected set and compared at the guard's exit and at
`g.check()`, so a change that no dispatched op reported (a numpy view, a raw pointer,
another thread, a compiled kernel) is still found. Digests read raw bits, so an
untouched NaN is no change and every dtype works (float8, unsigned, complex, bool).

CPU tensors go to one C call per batch (`kvguard._native.digest`: one pass over memory, no copy, the
GIL released). Other devices, and CPU without the C helper, use torch ops on the
tensor's own device in bounded chunks; the digest stays there as a 0-d tensor until a
comparison, which synchronises once per device.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from kvguard._torch import tensors as _tensors

_digest_c: Optional[Callable[[list[tuple[Any, ...]]], list[Optional[int]]]]
try:
    from kvguard._native.digest import digest as _digest_c
except ImportError:  # pragma: no cover - exercised by forcing the fallback in tests
    _digest_c = None

Digest = Any  # int (CPU), a 0-d int64 tensor (other devices), a tuple (sparse), or None
CHUNK = 1 << 20  # elements per step of the torch fallback: bounds its temporaries
_STRIDED = torch.strided
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_K1, _K2 = 0x5851F42D4C957F2D, 0x14057B7EF767814F  # odd int64 multipliers


def digests(tensors: Sequence[Optional[torch.Tensor]]) -> list[Digest]:
    """A digest per tensor; None where there is nothing to read (meta, freed, unreadable).

    Never raises: a tensor that cannot be read has no digest, so it is never reported
    as changed by value (its memory is still watched).
    """
    out: list[Digest] = [None] * len(tensors)
    batch: list[int] = []
    specs: list[tuple[Any, ...]] = []
    for i, tensor in enumerate(tensors):
        try:
            if (_digest_c is not None and type(tensor) in _tensors.PLAIN and tensor.is_cpu  # type: ignore[union-attr]
                    and tensor.layout is _STRIDED and not tensor.is_nested  # type: ignore[union-attr]
                    and not tensor.is_quantized):  # type: ignore[union-attr]
                # The common case, inlined: this loop runs once per protected tensor.
                storage = tensor.untyped_storage()  # type: ignore[union-attr]
                specs.append((storage.data_ptr(), storage.nbytes(), tensor.storage_offset(),  # type: ignore[union-attr]
                              tensor.element_size(), tensor.shape, tensor.stride()))  # type: ignore[union-attr]
                batch.append(i)
                continue
            parts = _parts(tensor) if tensor is not None else None
            if parts is not None and any(p.is_cuda for p in parts) and torch.cuda.is_current_stream_capturing():
                parts = None  # ops now would be recorded into the user's CUDA graph
            if parts is not None:
                out[i] = tuple(_one(p) for p in parts) if len(parts) > 1 else _one(parts[0])
        except Exception:  # noqa: BLE001 - no digest, never an error in the user's code
            out[i] = None
    if batch:
        assert _digest_c is not None
        for i, value in zip(batch, _digest_c(specs)):
            out[i] = value
    return out


def same_all(was: Sequence[Digest], now: Sequence[Digest]) -> list[bool]:
    """Whether each pair of digests agrees (None: not comparable, counted as agreeing).

    Digests on a device are compared there and read back in one transfer per device:
    the only host synchronisation fingerprints cause.
    """
    out = [True] * len(was)
    on_device: dict[Any, list[tuple[int, torch.Tensor]]] = {}
    for i, (a, b) in enumerate(zip(was, now)):
        if type(a) is int and type(b) is int:  # CPU digests: the common case first
            out[i] = a == b
            continue
        if a is None or b is None:
            continue
        if isinstance(a, tuple) or isinstance(b, tuple):
            out[i] = (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
                      and all(same_all(a, b)))
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device:
            on_device.setdefault(a.device, []).append((i, a != b))
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            out[i] = False  # the tensor moved between a device and the host
        else:
            out[i] = a == b
    for pairs in on_device.values():
        differs = torch.stack([d for _, d in pairs]).tolist()
        for (i, _), changed in zip(pairs, differs):
            out[i] = not changed
    return out


def same(a: Digest, b: Digest) -> bool:
    """Whether two digests of one tensor agree."""
    return same_all([a], [b])[0]


def _parts(t: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """The plain strided tensors holding `t`'s values (a subclass's inner data, sparse parts)."""
    try:
        out: list[torch.Tensor] = []
        for part in _tensors.plain_parts(t):
            if part.is_nested:
                if part.layout != torch.jagged:
                    return None  # a strided nested tensor has no flat view of its buffer here
                out.append(part.values())
            elif part.layout != torch.strided:
                out += _tensors.sparse_parts(part)
            elif part.device.type == "meta" or part.is_quantized:
                return None
            else:
                out.append(part)
        return out or None
    except Exception:  # noqa: BLE001 - an unreadable tensor has no digest, never an error
        return None


def _spec(t: torch.Tensor) -> tuple[Any, ...]:
    """What the C digest reads: the storage's bounds too, so it never reads outside them."""
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), t.storage_offset(), t.element_size(), t.shape, t.stride())


def _one(t: torch.Tensor) -> Digest:
    """The digest of one plain strided tensor: C on the CPU, else torch ops on its device."""
    if _digest_c is not None and t.device.type == "cpu":
        return _digest_c([_spec(t)])[0]
    return _torch_digest(t)


def _torch_digest(t: torch.Tensor) -> torch.Tensor:
    """Sum over elements of mix(bits, position), in chunks of CHUNK elements; int64 wraps."""
    with torch.no_grad():
        size = t.element_size()
        if t.is_complex():
            t = torch.view_as_real(t)
            size //= 2
        bits = t.detach().view(_INT_OF_SIZE[size]).reshape(-1)
        total = torch.zeros((), dtype=torch.int64, device=t.device)
        for start in range(0, bits.numel(), CHUNK):
            chunk = bits[start:start + CHUNK].to(torch.int64)
            position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=t.device)
            total += ((chunk ^ (position * _K1)) * _K2 + position).sum()
        return total + bits.numel()
