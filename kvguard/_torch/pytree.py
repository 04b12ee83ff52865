"""Pytree nodes as the tree walk reads them (`kvguard._protect.tree`): which types are
registered in `torch.utils._pytree`, and a node's children with the kind of key each has.

The walk imports this module only once torch is imported (it never imports torch itself),
and asks nothing else of the private pytree module. A torch without it has no nodes.
"""

from __future__ import annotations

from typing import Iterator, Literal, Mapping, NamedTuple, Optional

try:
    import torch.utils._pytree as _pytree
except Exception:  # noqa: BLE001 - a torch without it: no pytree nodes
    _pytree = None  # type: ignore[assignment]


class Child(NamedTuple):
    """One child of a pytree node: how its key reads, the key, and the child.

    `how` is "item" for a mapping key or a sequence index (`key` is the key or index), "attr"
    for an attribute (`key` is its name), "other" for a key class of the node's own (`key` is
    the key entry itself, which prints as its path suffix).
    """

    how: Literal["item", "attr", "other"]
    key: object
    value: object


def registered_nodes() -> Optional[Mapping[type, object]]:
    """Every type registered as a pytree node, by type (None in a torch without them)."""
    nodes = getattr(_pytree, "SUPPORTED_NODES", None)
    return nodes if isinstance(nodes, dict) else None


def children(obj: object) -> Iterator[Child]:
    """The children of a registered node, in order, through its flatten-with-keys function (its
    plain flatten, with indices for keys, where it has none); nothing for any other object.

    A flatten that raises raises here: the caller keeps what came before.
    """
    if _pytree is None:
        return
    node = _pytree.SUPPORTED_NODES.get(type(obj))
    if node is None:
        return
    if node.flatten_with_keys_fn is None:
        values, _ = node.flatten_fn(obj)
        for i, value in enumerate(values):
            yield Child("item", i, value)
        return
    pairs, _ = node.flatten_with_keys_fn(obj)
    for entry, value in pairs:
        if isinstance(entry, _pytree.MappingKey):
            yield Child("item", entry.key, value)
        elif isinstance(entry, _pytree.SequenceKey):
            yield Child("item", entry.idx, value)
        elif isinstance(entry, _pytree.GetAttrKey):
            yield Child("attr", entry.name, value)
        else:
            yield Child("other", entry, value)
