"""Walking guarded objects, and the placement check (the C helper and its Python twin)."""

from __future__ import annotations

import os
from collections import namedtuple
from typing import Any, Callable

import pytest
import torch

from kvguard._protect import tree as _tree


def is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def test_paths_are_python_expressions_and_shared_tensors_appear_under_each_path() -> None:
    Pair = namedtuple("Pair", "a b")
    t = torch.ones(1)
    obj = {"kl": [t, torch.zeros(1)], 3: Pair(t, None), ("x", 1): ({"deep": torch.ones(2)},)}
    leaves, containers = _tree.walk(obj, "rd", is_tensor)
    assert [leaf.path for leaf in leaves] == [
        "rd['kl'][0]", "rd['kl'][1]", "rd[3].a", "rd[('x', 1)][0]['deep']"]
    assert leaves[0].tensor is leaves[2].tensor
    assert leaves[0].chain == ((obj, "kl"), (obj["kl"], 0))
    assert obj in containers and obj["kl"] in containers  # tuples are immutable: not watched


def test_keys_and_ignore_filter_the_top_level_only() -> None:
    obj = {"a": torch.ones(1), "b": {"a": torch.ones(1)}}
    assert [lf.path for lf in _tree.walk(obj, "d", is_tensor, keys=("b",))[0]] == ["d['b']['a']"]
    assert [lf.path for lf in _tree.walk(obj, "d", is_tensor, ignore=("a",))[0]] == ["d['b']['a']"]


def test_cycles_are_walked_once() -> None:
    obj: dict[str, Any] = {"t": torch.ones(1)}
    obj["self"] = obj
    assert [lf.path for lf in _tree.walk(obj, "d", is_tensor)[0]] == ["d['t']"]


@pytest.fixture(params=["c", "python"])
def changed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], bool]:
    if request.param == "python":
        monkeypatch.setattr(_tree, "_same_values_c", None)
    elif _tree._same_values_c is None:
        pytest.skip("the optional C helper did not build here")
    return _tree.changed


MUTATIONS: list[tuple[str, Callable[[dict[str, Any]], None], bool]] = [
    ("nothing", lambda d: None, False),
    ("read", lambda d: d["kl"][0].sum(), False),
    ("replace-in-list", lambda d: d["kl"].__setitem__(1, torch.zeros(1)), True),
    ("append", lambda d: d["kl"].append(torch.zeros(1)), True),
    ("pop", lambda d: d["kl"].pop(), True),
    ("new-key", lambda d: d.__setitem__("new", 1), True),
    ("replace-value", lambda d: d.__setitem__("n", 5), True),
    ("same-value-again", lambda d: d.__setitem__("n", d["n"]), False),
    ("delete-key", lambda d: d.pop("n"), True),
    ("nested-list-append", lambda d: d["nested"][0].append(torch.ones(1)), True),
    ("swap-two-items", lambda d: d["kl"].reverse(), True),
]


@pytest.mark.parametrize("mutate, expected", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_changed_sees_every_store(changed: Callable[[Any], bool], mutate: Callable[[dict[str, Any]], None],
                                  expected: bool) -> None:
    obj: dict[str, Any] = {"kl": [torch.ones(1), torch.ones(1)], "n": 1000, "nested": [[torch.ones(1)]]}
    _, containers = _tree.walk(obj, "d", is_tensor)
    snap = _tree.snapshot(containers)
    mutate(obj)
    assert changed(snap) is expected


@pytest.mark.skipif(not os.environ.get("KVGUARD_REQUIRE_SPEEDUPS"), reason="only where a compiler is known")
def test_the_c_helper_built() -> None:
    assert _tree._same_values_c is not None, "kvguard._native.speedups did not build or import"


def test_the_c_helper_refuses_other_containers() -> None:
    if _tree._same_values_c is None:
        pytest.skip("the optional C helper did not build here")
    with pytest.raises(TypeError, match="lists and dicts only"):
        _tree._same_values_c(((1, 2),), (1, 2))


class Tagged(torch.Tensor):
    pass


class Noisy(list):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("a walk must read the list's storage, not iterate it")


def test_the_c_list_fast_path_gives_the_python_walks_leaves() -> None:
    if _tree._list_leaves_c is None:
        pytest.skip("the optional C helper did not build here")
    p = torch.nn.Parameter(torch.ones(1))
    t = torch.ones(2)
    obj = {"plain": [torch.ones(1), t, t], "mixed": [torch.ones(1), 3, "x"], "nested": [[p, torch.ones(1)], []],
           "noisy": Noisy([torch.ones(3)]), "empty": [], "sub": [torch.ones(1).as_subclass(Tagged)]}

    def key(leaves: list[_tree.Leaf]) -> list[tuple[Any, ...]]:
        return [(lf.path, id(lf.tensor), tuple((id(c), s) for c, s in lf.chain)) for lf in leaves]

    fast, fast_watched = _tree.walk(obj, "d", torch.Tensor)
    slow, slow_watched = _tree.walk(obj, "d", lambda v: isinstance(v, torch.Tensor))
    assert key(fast) == key(slow)
    assert [id(c) for c in fast_watched] == [id(c) for c in slow_watched]
    assert all(type(lf) is _tree.Leaf for lf in fast)
