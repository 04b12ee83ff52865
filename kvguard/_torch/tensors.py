"""A tensor's internals: its TensorImpl's identity, the plain tensors inside a subclass or a
sparse tensor, and whether two tensors lay out the same elements.

The memory arithmetic on top of these (byte spans, exact overlap) needs no private API and
lives with the protected set (`kvguard._protect.geometry`). Reads metadata only, except
`same_values`, which compares values, and `capturing`, which asks the CUDA stream.
"""

from __future__ import annotations

from typing import Hashable

import torch

# Plain tensors: no subclass hooks, so their metadata and memory can be read directly.
PLAIN = (torch.Tensor, torch.nn.Parameter)
STRIDED = torch.strided


def plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a wrapper subclass's data, or `[t]`.

    A DTensor's local shard, a jagged nested tensor's values and offsets: the memory a
    write through `w.to_local()` or `njt.values()` really touches.
    """
    if type(t) in PLAIN or not hasattr(type(t), "__tensor_flatten__"):
        return [t]
    try:
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = [getattr(t, name) for name in names]  # tensors, and for DTensor its mesh too
        return [p for x in inner if isinstance(x, torch.Tensor) for p in plain_parts(x)] or [t]
    except Exception:  # noqa: BLE001 - an odd subclass: matched by identity
        return [t]


def sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors a sparse tensor keeps (indices and values); [] for other layouts."""
    layout = t.layout
    if layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


def stored_values(t: torch.Tensor) -> torch.Tensor:
    """A sparse COO tensor's stored values, coalesced or not (`values()` refuses an uncoalesced one)."""
    return t._values()


def identity(tensor: torch.Tensor) -> int:
    """The address of the tensor's TensorImpl: the same for every Python object of one tensor."""
    return int(tensor._cdata)


def storage_address(tensor: torch.Tensor) -> int:
    """Where a tensor's storage starts (views of one storage share it); a tensor with no storage
    to read (a subclass) answers minus its id, never taken for another's."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - no storage to read
        return -id(tensor)


def storage_identity(tensor: torch.Tensor) -> int:
    """The address of the tensor's StorageImpl: views of one tensor share it (meta tensors too)."""
    return int(tensor.untyped_storage()._cdata)


def storage_fingerprint(t: torch.Tensor) -> tuple[Hashable, ...]:
    """Identity and layout facts that change when a tensor is re-pointed or swapped."""
    try:
        if t.layout != torch.strided:  # a sparse `add_` may reallocate its parts
            return (t._cdata, t.layout, tuple(t.shape), tuple(p.data_ptr() for p in sparse_parts(t)))
        ptr = t.data_ptr() if t.device.type != "meta" else 0
        return (t._cdata, ptr, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
    except Exception:  # noqa: BLE001
        return (id(t),)


def same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements in the same order (`x.add_(x)`, `add(x, 1, out=x)`)."""
    try:
        return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.stride() == b.stride()
                and a.shape == b.shape)  # a conj or neg view reads each element where it is written
    except Exception:  # noqa: BLE001
        return False


def same_elements(a: torch.Tensor, b: object) -> bool:
    """Whether `b` lays out exactly `a`'s elements (`m.to(its own device)` in `Module._apply` does
    `p.data = p`): re-pointing `a` to them changes nothing anyone reads. The same bytes in the same
    layout are the same elements, whichever storage object holds them (a numpy view of them too)."""
    try:
        return (isinstance(b, torch.Tensor) and type(b) in PLAIN and type(a) in PLAIN
                and a.layout == STRIDED and b.layout == STRIDED
                and a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr() != 0
                and a.shape == b.shape and a.stride() == b.stride())
    except Exception:  # noqa: BLE001 - judged as a re-point
        return False


def same_values(a: torch.Tensor, b: object) -> bool:
    """Whether `b` holds `a`'s values, in `a`'s shape, dtype and device, wherever they lie
    (`m.to(memory_format=...)` in `Module._apply` does `p.data = p.contiguous(memory_format)`).
    Reads both tensors once: for the rare re-pointing of a tensor autograd saved. NaN never
    equals NaN here, so such a tensor is judged changed."""
    try:
        return (isinstance(b, torch.Tensor) and type(b) in PLAIN and type(a) in PLAIN
                and a.layout == STRIDED and b.layout == STRIDED
                and a.device == b.device and a.device.type != "meta" and a.dtype == b.dtype
                and a.shape == b.shape and not a.is_quantized and bool(torch.equal(a, b)))
    except Exception:  # noqa: BLE001 - judged as changed
        return False


def still_landing(tensor: torch.Tensor) -> bool:
    """Whether a `non_blocking` copy may still be writing the tensor: pinned CPU memory in a process
    that has used CUDA (no CUDA, no pinned memory: never)."""
    try:
        return bool(torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
                    and tensor.is_cpu and tensor.is_pinned())
    except Exception:  # noqa: BLE001 - a subclass or layout that cannot say
        return False


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph: reading a value now (a
    copy to the host, `.item()`) would break the user's capture, so a report reads none."""
    try:
        return bool(torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
                    and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - a build without CUDA: never capturing
        return False
