"""Walk nested dicts, lists and tuples to the tensors inside, with paths you can paste.

Stdlib only: a leaf is a tensor when `is_tensor(leaf)` says so, so this module never
imports torch.
"""

from __future__ import annotations

import ctypes
import sys
from itertools import chain
from operator import is_
from typing import Any, Callable, Collection, Iterator, NamedTuple, Optional

Container = Any  # dict | list | tuple


class Leaf(NamedTuple):
    """A tensor found in the tree: its path, itself, and `(container, key)` from the root."""

    path: str
    tensor: Any
    chain: tuple[tuple[Container, Any], ...]


def child_items(obj: Container) -> Iterator[tuple[Any, str, Any]]:
    """`(key, path suffix, child)` of one container: `['kl']`, `[0]`, `.field`."""
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            yield key, f"[{key!r}]", value
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        for field, value in zip(obj._fields, obj):
            yield field, f".{field}", value
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(list(obj)):
            yield i, f"[{i}]", value


def is_container(obj: Any) -> bool:
    return isinstance(obj, (dict, list, tuple))


def walk(
    root: Any,
    name: str,
    is_tensor: Callable[[Any], bool],
    keys: Optional[Collection[Any]] = None,
    ignore: Collection[Any] = (),
) -> tuple[list[Leaf], list[Container]]:
    """All tensor leaves under `root` and every mutable container on the way.

    `keys` and `ignore` filter the top level only (dict keys or sequence indices). A
    container met twice (shared or cyclic) is walked once; a tensor reachable by two
    paths is listed under both, in walk order.
    """
    leaves: list[Leaf] = []
    containers: list[Container] = []
    seen: set[int] = set()

    def visit(obj: Any, path: str, chain: tuple[tuple[Container, Any], ...]) -> None:
        if is_tensor(obj):
            leaves.append(Leaf(path, obj, chain))  # a tensor under two paths appears twice
            return
        if not is_container(obj) or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (dict, list)):
            containers.append(obj)
        for key, suffix, child in child_items(obj):
            if not chain and (key in ignore or (keys is not None and key not in keys)):
                continue
            visit(child, path + suffix, chain + ((obj, key),))

    visit(root, name, ())
    return leaves, containers


# Long lists are compared by the raw array of item pointers CPython keeps for them: one
# memcpy instead of one `id()` per item. The layout is checked on a probe list at import
# (free-threaded builds, other interpreters: fall back to ids everywhere).
_PTR = ctypes.sizeof(ctypes.c_void_p)
_OB_ITEM = 3 * _PTR  # PyListObject: ob_refcnt, ob_type, ob_size, then ob_item
_LONG_LIST = 32


def _probe_list_layout() -> bool:
    probe = [object(), object(), object()]
    try:
        items = ctypes.c_void_p.from_address(id(probe) + _OB_ITEM).value
        raw = ctypes.string_at(items, len(probe) * _PTR) if items else b""
        return raw == b"".join(id(x).to_bytes(_PTR, sys.byteorder) for x in probe)
    except Exception:  # noqa: BLE001
        return False


_RAW_LISTS = sys.implementation.name == "cpython" and _probe_list_layout()


class _RawList(NamedTuple):
    items: Any  # c_void_p at the list's ob_item field (the list is held, so it stays valid)
    lst: list[Any]
    raw: bytes


def _raw(entry: _RawList) -> bytes:
    n = len(entry.lst)
    return ctypes.string_at(entry.items.value, n * _PTR) if n else b""


class Snapshot(NamedTuple):
    """What every watched container held, in a form that is cheap to compare again.

    Holds the containers and (until the next snapshot) the values they held, so no
    address can be reused by a new object while the snapshot is compared against.
    """

    views: tuple[Any, ...]  # short lists themselves, each dict's live `.values()`
    held: tuple[Any, ...]  # their values, in order
    long_lists: tuple[_RawList, ...]


def snapshot(containers: list[Container]) -> Snapshot:
    """Remember what every container holds, to notice placements cheaply."""
    views, long_lists = [], []
    for c in containers:
        if isinstance(c, dict):
            views.append(c.values())
        elif _RAW_LISTS and type(c) is list and len(c) >= _LONG_LIST:
            entry = _RawList(ctypes.c_void_p.from_address(id(c) + _OB_ITEM), c, b"")
            long_lists.append(entry._replace(raw=_raw(entry)))
        else:
            views.append(c)
    return Snapshot(tuple(views), tuple(chain.from_iterable(views)), tuple(long_lists))


def changed(snap: Snapshot) -> bool:
    """Whether any watched container gained, lost or replaced a value.

    On the path of every write op, so both checks run in C: a memcmp of each long
    list's item pointers, and an identity comparison of everything else. A value that
    moved from one short container to another is not a change (nothing new became
    reachable).
    """
    for entry in snap.long_lists:
        if _raw(entry) != entry.raw:
            return True
    views = snap.views
    return sum(map(len, views)) != len(snap.held) or not all(map(is_, chain.from_iterable(views), snap.held))
