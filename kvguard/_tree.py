"""Walk nested dicts, lists and tuples to the tensors inside, with paths you can paste.

Stdlib only: a leaf is a tensor when `is_tensor(leaf)` says so, so this module never
imports torch.
"""

from __future__ import annotations

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
    container met twice (shared or cyclic) is walked once; so is a tensor, under the
    first path that reaches it.
    """
    leaves: list[Leaf] = []
    containers: list[Container] = []
    seen: set[int] = set()

    def visit(obj: Any, path: str, chain: tuple[tuple[Container, Any], ...]) -> None:
        if is_tensor(obj):
            if id(obj) not in seen:
                seen.add(id(obj))
                leaves.append(Leaf(path, obj, chain))
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


def snapshot(containers: list[Container]) -> list[tuple[Container, tuple[int, ...]]]:
    """The identity of every value in each container, to notice placements cheaply."""
    return [(c, _ids(c)) for c in containers]


def _ids(c: Container) -> tuple[int, ...]:
    return tuple(map(id, c.values() if isinstance(c, dict) else c))


def changed(snap: list[tuple[Container, tuple[int, ...]]]) -> bool:
    """Whether any watched container gained, lost or replaced a value."""
    for c, ids in snap:
        if _ids(c) != ids:
            return True
    return False
