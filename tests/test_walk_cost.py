"""A walk's fixed costs: no `_kind` per walk for the common types, the pytree registry found once,
and what a registration between two walks changes is still seen by the second."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvguard._protect import tree


def test_common_types_need_no_kind_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[type] = []
    real = tree._kind
    monkeypatch.setattr(tree, "_kind", lambda tp, nodes: asked.append(tp) or real(tp, nodes))
    rd = {"lengths": [64] * 8, "names": ["a", None, 1.5, True, b"x"], "t": (torch.ones(1),), "l": [torch.ones(1)]}
    leaves, watched = tree.walk(rd, "rd", torch.Tensor)
    assert [leaf.path for leaf in leaves] == ["rd['t'][0]", "rd['l'][0]"]
    assert asked == []


def test_a_pytree_node_registered_between_walks_is_walked_by_the_next() -> None:
    import torch.utils._pytree as pytree

    class Pair:
        def __init__(self, a: Any, b: Any) -> None:
            self.a, self.b = a, b

    obj = {"p": Pair(torch.ones(1), torch.zeros(1))}
    before, _ = tree.walk(obj, "obj", torch.Tensor)
    pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda xs, _: Pair(*xs))
    try:
        after, _ = tree.walk(obj, "obj", torch.Tensor)
    finally:
        pytree._deregister_pytree_node(Pair) if hasattr(pytree, "_deregister_pytree_node") else None
    assert len(before) == 0 and len(after) == 2  # a plain object is a leaf; a registered node has children


def test_owners_are_owner_tuples() -> None:
    owners: dict[int, tree.Owner] = {}
    rd = {"l": [torch.ones(1)]}
    tree.walk(rd, "rd", torch.Tensor, owners=owners)
    found = owners[id(rd["l"])]
    assert type(found) is tree.Owner and found.path == "rd['l']" and found.chain == ((rd, "l"),)
