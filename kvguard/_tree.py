"""Walk nested dicts, lists and tuples to the tensors inside, with paths you can paste.

Stdlib only: a leaf is a tensor when `is_tensor(leaf)` says so, so this module never
imports torch.
"""

from __future__ import annotations

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


_same_values_c: Optional[Callable[[tuple[Any, ...], tuple[Any, ...]], bool]]
try:  # the same check in C, when the optional extension built
    from kvguard._speedups import same_values as _same_values_c
except ImportError:  # pragma: no cover - exercised by forcing the fallback in tests
    _same_values_c = None


class Snapshot(NamedTuple):
    """What every watched container held, in a form that is cheap to compare again.

    Holds the containers and (until the next snapshot) the values they held, so no
    address can be reused by a new object while the snapshot is compared against.
    """

    containers: tuple[Any, ...]  # the dicts and lists themselves
    views: tuple[Any, ...]  # each list, and each dict's live `.values()` (the Python check)
    held: tuple[Any, ...]  # their values, in order


def snapshot(containers: list[Container]) -> Snapshot:
    """Remember what every container holds, to notice placements cheaply."""
    views = tuple(c.values() if isinstance(c, dict) else c for c in containers)
    return Snapshot(tuple(containers), views, tuple(chain.from_iterable(views)))


def changed(snap: Snapshot) -> bool:
    """Whether any watched container gained, lost or replaced a value.

    On the path of every write op: one identity comparison of every value, in C (the
    `_speedups` extension, about a nanosecond a value) or, without it, in `map`/`all`.
    A value that moved from one container to another is not a change: nothing new
    became reachable.
    """
    if _same_values_c is not None:
        return not _same_values_c(snap.containers, snap.held)
    return _changed_py(snap)


def _changed_py(snap: Snapshot) -> bool:
    views = snap.views
    return sum(map(len, views)) != len(snap.held) or not all(map(is_, chain.from_iterable(views), snap.held))
