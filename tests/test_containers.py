"""Containers real trainers use: TensorDict, verl's DataProto, OpenRLHF's Experience, ...

Each container kind gets the same four checks: a write to a protected tensor is caught
with the right path, a tensor placed inside the guard is protected from that moment
(with `placed_at` naming the store), a write to an unrelated tensor is not reported, and
the guard keeps nothing alive after exit. Then the adversarial ones: cycles, slots,
frozen dataclasses, Mappings and properties that raise, a huge defaultdict, `__eq__`
that raises.

Lines that tests point at carry a ``# MARK: name`` comment; `_site("name")` finds them.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import subprocess
import sys
import time
import types
import warnings
import weakref
from collections import OrderedDict, UserDict, defaultdict, deque, namedtuple
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import kvguard
from kvguard._protect import tree as _tree

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict

THIS_FILE = os.path.basename(__file__)
_SOURCE = Path(__file__).read_text().splitlines()


def _site(mark: str) -> str:
    hits = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# MARK: {mark}")]
    assert len(hits) == 1, f"marker {mark!r} found {len(hits)} times"
    return f"{THIS_FILE}:{hits[0]}"


def _paths(g: Any) -> list[str]:
    return [e.path for e in g.report.events]


# --------------------------------------------------------------------------------------------
# the shapes trainers pass around


@dataclasses.dataclass
class Experience:
    """OpenRLHF's `Experience`, field for field."""

    sequences: torch.Tensor
    action_log_probs: torch.Tensor
    values: Optional[torch.Tensor]
    returns: Optional[torch.Tensor]
    advantages: Optional[torch.Tensor]
    attention_mask: Optional[torch.Tensor]
    action_mask: Optional[torch.Tensor]
    info: Optional[dict[str, Any]]
    kl: Optional[torch.Tensor] = None


@dataclasses.dataclass
class DataProto:
    """verl's `DataProto`: a TensorDict batch, numpy arrays, and meta information."""

    batch: Any = None
    non_tensor_batch: dict[str, Any] = dataclasses.field(default_factory=dict)
    meta_info: dict[str, Any] = dataclasses.field(default_factory=dict)


Sample = namedtuple("Sample", "logits extra")


class Pair:
    """A user class registered as a pytree node, with keyed children (`p.a`, `p.b`)."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


class Bag:
    """A pytree node registered without a keyed flatten: children are numbered."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items


if Pair not in pytree.SUPPORTED_NODES:
    pytree.register_pytree_node(
        Pair, lambda p: ([p.a, p.b], None), lambda xs, _: Pair(*xs),
        flatten_with_keys_fn=lambda p: ([(pytree.GetAttrKey("a"), p.a), (pytree.GetAttrKey("b"), p.b)], None))
if Bag not in pytree.SUPPORTED_NODES:
    pytree.register_pytree_node(Bag, lambda b: (list(b.items), None), lambda xs, _: Bag(list(xs)))


def _experience() -> Experience:
    n = 4
    return Experience(
        sequences=torch.arange(8).reshape(2, 4), action_log_probs=torch.randn(2, n), values=torch.randn(2, n),
        returns=None, advantages=None, attention_mask=torch.ones(2, 4, dtype=torch.bool),
        action_mask=torch.ones(2, n, dtype=torch.bool), info={"reward": torch.randn(2)})


def _data_proto() -> DataProto:
    batch = TensorDict({"old_log_probs": torch.randn(2, 4), "kl": torch.randn(2, 4),
                        "nested": TensorDict({"ref": torch.randn(2, 4)}, batch_size=[2])}, batch_size=[2])
    return DataProto(batch=batch, non_tensor_batch={"uid": np.array(["a", "b"], dtype=object)},
                     meta_info={"temperature": 1.0, "global_steps": 3})


# --------------------------------------------------------------------------------------------
# one case per container kind: build it, write a protected tensor, place a new one


@dataclasses.dataclass
class Case:
    name: str
    make: Callable[[], Any]
    write: Callable[[Any], None]  # writes one protected tensor in place
    written: str  # the path that write must report, with the guard named "obj"
    place: Callable[[Any, torch.Tensor], None]  # stores the tensor and writes it, in one frame
    placed: str  # the path of the placed tensor


def place_experience(exp: Any, t: torch.Tensor) -> None:
    exp.kl = t  # MARK: experience
    t.mul_(2)


def place_data_proto(batch: Any, t: torch.Tensor) -> None:
    batch.batch["returns"] = t  # MARK: data_proto
    t.mul_(2)


def place_tensordict(td: Any, t: torch.Tensor) -> None:
    td["returns"] = t  # MARK: tensordict
    t.mul_(2)


def place_namespace(ns: Any, t: torch.Tensor) -> None:
    ns.x = t  # MARK: namespace
    t.mul_(2)


def place_namedtuple(sample: Any, t: torch.Tensor) -> None:
    sample.extra.append(t)  # MARK: namedtuple
    t.mul_(2)


def place_ordereddict(od: Any, t: torch.Tensor) -> None:
    od["returns"] = t  # MARK: ordereddict
    t.mul_(2)


def place_defaultdict(dd: Any, t: torch.Tensor) -> None:
    dd["returns"].append(t)  # MARK: defaultdict
    t.mul_(2)


def place_userdict(ud: Any, t: torch.Tensor) -> None:
    ud["returns"] = t  # MARK: userdict
    t.mul_(2)


def place_pair(p: Any, t: torch.Tensor) -> None:
    p.b = t  # MARK: pair
    t.mul_(2)


def place_in_dict_of_experience(rollout_data: Any, t: torch.Tensor) -> None:
    exp = rollout_data["exp"]
    setattr(exp, "kl", t)  # MARK: setattr
    t.mul_(2)


CASES = [
    Case("experience", _experience, lambda e: e.values.mul_(0.5), "obj.values", place_experience, "obj.kl"),
    Case("data_proto", _data_proto, lambda b: b.batch["kl"].mul_(-1), "obj.batch['kl']",
         place_data_proto, "obj.batch['returns']"),
    Case("tensordict", lambda: _data_proto().batch, lambda td: td["nested", "ref"].add_(1), "obj['nested']['ref']",
         place_tensordict, "obj['returns']"),
    Case("namespace", lambda: types.SimpleNamespace(kl=torch.ones(3), lr=0.1), lambda ns: ns.kl.zero_(), "obj.kl",
         place_namespace, "obj.x"),
    Case("namedtuple", lambda: Sample(torch.ones(3), []), lambda s: s.logits.add_(1), "obj.logits",
         place_namedtuple, "obj.extra[0]"),
    Case("ordereddict", lambda: OrderedDict(kl=torch.ones(3)), lambda od: od["kl"].add_(1), "obj['kl']",
         place_ordereddict, "obj['returns']"),
    Case("defaultdict", lambda: defaultdict(list, kl=[torch.ones(3)]), lambda dd: dd["kl"][0].add_(1),
         "obj['kl'][0]", place_defaultdict, "obj['returns'][0]"),
    Case("userdict", lambda: UserDict(kl=torch.ones(3)), lambda ud: ud["kl"].add_(1), "obj['kl']",
         place_userdict, "obj['returns']"),
    Case("pytree-node", lambda: Pair(torch.ones(3), None), lambda p: p.a.add_(1), "obj.a", place_pair, "obj.b"),
    Case("dict-of-dataclass", lambda: {"exp": _experience()}, lambda d: d["exp"].sequences.add_(1),
         "obj['exp'].sequences", place_in_dict_of_experience, "obj['exp'].kl"),
]
IDS = [c.name for c in CASES]
MARKS = {"dict-of-dataclass": "setattr", "pytree-node": "pair"}


@pytest.fixture(params=["c", "python"])
def check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run with the C placement check, and again with its Python twin."""
    if request.param == "python":
        monkeypatch.setattr(_tree, "_same_values_c", None)
    elif _tree._same_values_c is None:
        pytest.skip("the optional C helper did not build here")
    return str(request.param)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_write_to_a_protected_tensor_is_caught_with_its_path(case: Case) -> None:
    obj = case.make()
    with kvguard.guard(obj, name="obj", action="record") as g:
        case.write(obj)
    assert _paths(g) == [case.written]
    assert g.report.events[0].kind == "write"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_raise_stops_the_write_before_it_happens(case: Case) -> None:
    obj = case.make()
    leaves, _ = _tree.walk(obj, "obj", lambda v: isinstance(v, torch.Tensor))
    before = {leaf.path: leaf.tensor.clone() for leaf in leaves}
    with pytest.raises(kvguard.MutationError, match=case.written.replace("[", r"\[").replace(".", r"\.")):
        with kvguard.guard(obj, name="obj"):
            case.write(obj)
    for leaf in _tree.walk(obj, "obj", lambda v: isinstance(v, torch.Tensor))[0]:
        assert torch.equal(leaf.tensor, before[leaf.path]), leaf.path


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_tensor_placed_inside_the_guard_is_protected_from_that_moment(case: Case, check: str) -> None:
    obj = case.make()
    t = torch.ones(2, 4) if case.name in ("data_proto", "tensordict") else torch.ones(3)
    t.add_(1)  # before the guard: never reported
    with kvguard.guard(obj, name="obj", action="record") as g:
        t.add_(1)  # not placed yet: not reported
        case.place(obj, t)
    assert _paths(g) == [case.placed]
    assert g.report.events[0].placed_at == _site(MARKS.get(case.name, case.name))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_placed_tensor_is_protected_under_raise(case: Case) -> None:
    obj = case.make()
    t = torch.ones(2, 4) if case.name in ("data_proto", "tensordict") else torch.ones(3)
    with pytest.raises(kvguard.MutationError):
        with kvguard.guard(obj, name="obj"):
            case.place(obj, t)
    assert bool((t == 1).all()), "the placed tensor was written although the guard raised"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_write_to_an_unrelated_tensor_is_not_reported(case: Case, check: str) -> None:
    obj = case.make()
    with kvguard.guard(obj, name="obj", action="record") as g:
        scratch = torch.ones(16)
        scratch.mul_(2)
        torch.add(scratch, 1, out=scratch)
        for leaf in _tree.walk(obj, "obj", lambda v: isinstance(v, torch.Tensor))[0]:
            leaf.tensor.float().sum()  # reads of protected tensors
    assert g.report.ok, _paths(g)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_guard_keeps_nothing_alive_after_exit(case: Case) -> None:
    obj = case.make()
    leaves = _tree.walk(obj, "obj", lambda v: isinstance(v, torch.Tensor))[0]
    refs = [weakref.ref(leaf.tensor) for leaf in leaves]
    placed = torch.ones(2, 4) if case.name in ("data_proto", "tensordict") else torch.ones(3)
    refs.append(weakref.ref(placed))
    try:
        refs.append(weakref.ref(obj))
    except TypeError:  # namedtuples, SimpleNamespace, defaultdict: no weak references
        pass
    with kvguard.guard(obj, name="obj", action="record") as g:
        case.write(obj)
        case.place(obj, placed)
    assert len(g.report.events) == 2
    del obj, leaves, placed
    gc.collect()
    assert [r() for r in refs if r() is not None] == [], "the guard or its report keeps something alive"
    assert g.report.events


def _form_attr_item(exp: Any, td: Any, t: torch.Tensor) -> str:
    exp.info["kl"] = t  # MARK: form-attr-item
    t.add_(1)
    return "form-attr-item"


def _form_attr_list(exp: Any, td: Any, t: torch.Tensor) -> str:
    exp.info["kls"].append(t)  # MARK: form-attr-list
    t.add_(1)
    return "form-attr-list"


def _form_dunder_setattr(exp: Any, td: Any, t: torch.Tensor) -> str:
    exp.__setattr__("kl", t)  # MARK: form-dunder-setattr
    t.add_(1)
    return "form-dunder-setattr"


def _form_dict_of_instance(exp: Any, td: Any, t: torch.Tensor) -> str:
    exp.__dict__["kl"] = t  # MARK: form-dict-of-instance
    t.add_(1)
    return "form-dict-of-instance"


def _form_td_set(exp: Any, td: Any, t: torch.Tensor) -> str:
    td.set("returns", t)  # MARK: form-td-set
    t.add_(1)
    return "form-td-set"


def _form_td_update(exp: Any, td: Any, t: torch.Tensor) -> str:
    td.update({"returns": t})  # MARK: form-td-update
    t.add_(1)
    return "form-td-update"


def _form_tuple_target(exp: Any, td: Any, t: torch.Tensor) -> str:
    exp.kl, exp.returns = t, None  # MARK: form-tuple-target
    t.add_(1)
    return "form-tuple-target"


@pytest.mark.parametrize("form, path", [
    (_form_attr_item, "rd['exp'].info['kl']"), (_form_attr_list, "rd['exp'].info['kls'][0]"),
    (_form_dunder_setattr, "rd['exp'].kl"), (_form_dict_of_instance, "rd['exp'].kl"),
    (_form_td_set, "rd['td']['returns']"), (_form_td_update, "rd['td']['returns']"),
    (_form_tuple_target, "rd['exp'].kl"),
], ids=lambda v: v.__name__[6:] if callable(v) else None)
def test_placement_forms_into_attribute_containers_are_located(form: Any, path: str) -> None:
    exp = _experience()
    exp.info = {"kls": []}
    rd = {"exp": exp, "td": TensorDict({}, batch_size=[3])}
    with kvguard.guard(rd, name="rd", action="record") as g:
        mark = form(exp, rd["td"], torch.ones(3))
    assert _paths(g) == [path]
    assert g.report.events[0].placed_at == _site(mark)


# --------------------------------------------------------------------------------------------
# paths and what is walked


def test_paths_read_like_python() -> None:
    rollout_data = {"exp": _experience(), "proto": _data_proto(), "pair": Pair(torch.ones(1), Bag([torch.ones(1)])),
                    "ns": types.SimpleNamespace(t=torch.ones(1)), "q": deque([torch.ones(1)])}
    paths = [lf.path for lf in _tree.walk(rollout_data, "rollout_data", lambda v: isinstance(v, torch.Tensor))[0]]
    assert paths == [
        "rollout_data['exp'].sequences", "rollout_data['exp'].action_log_probs", "rollout_data['exp'].values",
        "rollout_data['exp'].attention_mask", "rollout_data['exp'].action_mask",
        "rollout_data['exp'].info['reward']",
        "rollout_data['proto'].batch['old_log_probs']", "rollout_data['proto'].batch['kl']",
        "rollout_data['proto'].batch['nested']['ref']",
        "rollout_data['pair'].a", "rollout_data['pair'].b[0]",
        "rollout_data['ns'].t", "rollout_data['q'][0]",
    ]


def test_a_lazy_stack_of_tensordicts_is_walked_through_its_pytree_node() -> None:
    tds = [TensorDict({"kl": torch.ones(3)}, batch_size=[]) for _ in range(2)]
    lazy = tensordict.LazyStackedTensorDict.lazy_stack(tds)
    with kvguard.guard(lazy, name="lazy", action="record") as g:
        tds[1]["kl"].add_(1)
    assert _paths(g) == ["lazy[1]['kl']"]


def test_what_is_not_walked_is_a_leaf() -> None:
    class Plain:  # an arbitrary object: its attributes are not walked
        def __init__(self) -> None:
            self.t = torch.ones(1)

    import argparse
    obj = {"plain": Plain(), "module": torch.nn.Linear(1, 1), "args": argparse.Namespace(t=torch.ones(1)),
           "array": np.ones(2), "cls": Experience, "t": torch.ones(1)}
    assert [lf.path for lf in _tree.walk(obj, "d", lambda v: isinstance(v, torch.Tensor))[0]] == ["d['t']"]
    for unwalked in (Plain(), argparse.Namespace(), 42, Experience):
        assert not kvguard._guard.target.guardable(unwalked)
    with pytest.raises(TypeError, match="argparse.Namespace, whose attributes kvguard does not walk"):
        kvguard.guard(argparse.Namespace(t=torch.ones(1)))
    with pytest.raises(TypeError, match="the class .*Experience itself, not an instance"):
        kvguard.guard(Experience)


@pytest.mark.parametrize("make", [
    lambda: _experience(), lambda: types.SimpleNamespace(), lambda: UserDict(), lambda: Pair(None, None),
    lambda: _data_proto().batch, lambda: OrderedDict(), lambda: Sample(None, None)],
    ids=["dataclass", "namespace", "userdict", "pytree-node", "tensordict", "ordereddict", "namedtuple"])
def test_every_container_kind_is_guardable(make: Callable[[], Any]) -> None:
    assert kvguard._guard.target.guardable(make())


def test_a_guard_over_a_container_without_tensors_still_warns() -> None:
    batch = DataProto(batch=None, non_tensor_batch={"uid": np.ones(2)}, meta_info={"step": 1})
    with pytest.warns(kvguard.GuardWarning, match="protected no tensor"):
        with kvguard.guard(batch, name="batch"):
            torch.ones(2).add_(1)


def test_keys_name_fields_of_a_dataclass() -> None:
    exp = _experience()
    with kvguard.guard(exp, name="exp", action="record", keys=("values",)) as g:
        exp.sequences.add_(1)
        exp.values.add_(1)
    assert _paths(g) == ["exp.values"]


def test_tree_stays_torch_free_at_import() -> None:
    code = "import sys, kvguard._protect.tree, kvguard._protect.frames; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------
# adversarial


def test_cycles_through_attributes_are_walked_once() -> None:
    a = types.SimpleNamespace(t=torch.ones(1))
    b = types.SimpleNamespace(t=torch.ones(1), back=a)
    a.other = b
    a.me = a
    exp = _experience()
    exp.info = {"exp": exp, "ns": a}  # type: ignore[assignment]
    paths = [lf.path for lf in _tree.walk(exp, "exp", lambda v: isinstance(v, torch.Tensor))[0]]
    assert paths[-2:] == ["exp.info['ns'].t", "exp.info['ns'].other.t"]
    with kvguard.guard(exp, name="exp", action="record") as g:
        b.t.add_(1)
        a.new = torch.ones(2)
        a.new.add_(1)
    assert _paths(g) == ["exp.info['ns'].other.t", "exp.info['ns'].new"]


def test_a_deep_chain_of_attributes_does_not_overflow_the_stack() -> None:
    head = node = types.SimpleNamespace()
    for _ in range(5000):
        node.next = types.SimpleNamespace()
        node = node.next
    node.t = torch.ones(1)
    leaves, _ = _tree.walk(head, "head", lambda v: isinstance(v, torch.Tensor))
    assert len(leaves) == 1 and leaves[0].path.endswith(".next.t")


@dataclasses.dataclass(slots=True)
class Slotted:
    logits: torch.Tensor
    kl: Optional[torch.Tensor] = None


def test_a_slotted_dataclass_is_walked_and_watched() -> None:
    s = Slotted(torch.ones(3))
    with kvguard.guard(s, name="s", action="record") as g:
        s.logits.add_(1)
        t = torch.ones(2)
        s.kl = t  # MARK: slotted
        t.add_(1)
    assert _paths(g) == ["s.logits", "s.kl"]
    assert g.report.events[1].placed_at == _site("slotted")


def test_an_unset_slot_is_skipped_and_setting_it_is_a_placement() -> None:
    s = Slotted.__new__(Slotted)  # no slot set: reading one raises AttributeError
    assert _tree.walk(s, "s", lambda v: isinstance(v, torch.Tensor))[0] == []
    with kvguard.guard(s, name="s", action="record") as g:
        s.logits = torch.ones(1)
        s.logits.add_(1)
    assert _paths(g) == ["s.logits"]


@dataclasses.dataclass(frozen=True)
class Frozen:
    logits: torch.Tensor
    kl: Optional[torch.Tensor] = None


def test_a_frozen_dataclass_is_walked_and_a_bypassing_store_is_noticed() -> None:
    f = Frozen(torch.ones(3))
    with kvguard.guard(f, name="f", action="record") as g:
        f.logits.add_(1)
        t = torch.ones(2)
        object.__setattr__(f, "kl", t)  # MARK: frozen
        t.add_(1)
    assert _paths(g) == ["f.logits", "f.kl"]
    assert g.report.events[1].placed_at == _site("frozen")


class Counting(Mapping[str, Any]):
    """A Mapping that computes a fresh tensor on every read and counts its reads."""

    def __init__(self) -> None:
        self.reads = 0
        self.stored = {"kept": torch.ones(3)}

    def __getitem__(self, key: str) -> Any:
        self.reads += 1
        if key == "fresh":
            return torch.zeros(3)
        if key == "broken":
            raise RuntimeError("lookup failed")
        return self.stored[key]

    def __iter__(self) -> Iterator[str]:
        return iter(["kept", "fresh", "broken"])

    def __len__(self) -> int:
        return 3


def test_a_mapping_whose_getitem_has_side_effects_or_raises() -> None:
    m = Counting()
    with kvguard.guard(m, name="m", action="record") as g:
        reads_after_enter = m.reads
        for _ in range(50):
            torch.ones(1).add_(1)  # write ops: no rescan, so no further reads
        assert m.reads == reads_after_enter, "the guard re-read the Mapping at every write op"
        m["kept"].add_(1)
        m.stored["new"] = torch.ones(1)  # its storage changed: looked at again
        torch.ones(1).add_(1)
    assert reads_after_enter == 3
    assert _paths(g) == ["m['kept']"]


class SlottedMapping(Mapping[str, Any]):
    """A Mapping that keeps its storage dict in a slot."""

    __slots__ = ("store",)

    def __init__(self) -> None:
        self.store: dict[str, Any] = {"a": torch.ones(1)}

    def __getitem__(self, key: str) -> Any:
        return self.store[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.store)

    def __len__(self) -> int:
        return len(self.store)


def test_a_store_into_a_mapping_storage_kept_in_a_slot_is_noticed() -> None:
    m = SlottedMapping()
    with kvguard.guard(m, name="m", action="record") as g:
        m.store["b"] = torch.ones(1)
        m["b"].add_(1)
    assert _paths(g) == ["m['b']"]


class EndlessIter(Mapping[int, Any]):
    def __getitem__(self, key: int) -> Any:
        return torch.ones(1)

    def __iter__(self) -> Iterator[int]:
        return iter(range(10**12))

    def __len__(self) -> int:
        return 2


def test_a_mapping_is_read_for_at_most_its_length() -> None:
    leaves, _ = _tree.walk(EndlessIter(), "m", lambda v: isinstance(v, torch.Tensor))
    assert [lf.path for lf in leaves] == ["m[0]", "m[1]"]


class RaisingProperty:
    @property
    def boom(self) -> Any:
        raise RuntimeError("property raised")


@dataclasses.dataclass
class WithProperty(RaisingProperty):
    t: torch.Tensor


class BadFlatten:
    def __init__(self) -> None:
        self.t = torch.ones(1)


if BadFlatten not in pytree.SUPPORTED_NODES:
    pytree.register_pytree_node(BadFlatten, lambda b: 1 / 0, lambda xs, _: BadFlatten())  # type: ignore[arg-type,return-value]


class RaisingDict:
    """`__dict__` is a property that raises."""

    @property
    def __dict__(self) -> Any:  # type: ignore[override]
        raise RuntimeError("no dict for you")


def test_properties_and_flattens_that_raise_hide_only_themselves() -> None:
    obj = {"p": WithProperty(torch.ones(1)), "bad": BadFlatten(), "ok": torch.ones(1),
           "ns": Pair(RaisingDict(), torch.ones(1))}
    with kvguard.guard(obj, name="obj", action="record") as g:
        obj["p"].t.add_(1)
        obj["bad"].t.add_(1)  # its flatten raises: not walked, not reported
        obj["ok"].add_(1)
        obj["ns"].b.add_(1)
    assert _paths(g) == ["obj['p'].t", "obj['ok']", "obj['ns'].b"]


class BadEq:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("__eq__ raised")

    def __hash__(self) -> int:
        return 1

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ raised")


def test_objects_whose_eq_or_repr_raise() -> None:
    key = BadEq()
    obj = {key: torch.ones(1), "v": BadEq(), "ns": types.SimpleNamespace(x=BadEq(), t=torch.ones(1)),
           "td": TensorDict({"a": torch.ones(2)}, batch_size=[2])}  # a TensorDict's == is elementwise
    with kvguard.guard(obj, name="obj", action="record", ignore=("v",)) as g:
        obj[key].add_(1)
        obj["ns"].t.add_(1)
        obj["td"]["a"].add_(1)
        obj["new"] = torch.ones(1)
        obj["new"].add_(1)
    assert _paths(g) == ["obj[<BadEq>]", "obj['ns'].t", "obj['td']['a']", "obj['new']"]
    with kvguard.guard(obj, name="obj", action="record", keys=("ns",)) as g2:  # `key in keys` raises
        obj[key].add_(1)
        obj["ns"].t.add_(1)
    assert _paths(g2) == ["obj['ns'].t"]


def test_a_huge_defaultdict_is_walked_without_calling_its_factory() -> None:
    calls = []

    def factory() -> list[Any]:
        calls.append(1)
        return []

    dd: defaultdict[Any, Any] = defaultdict(factory, {i: i for i in range(200_000)})
    dd["kl"] = [torch.ones(3)]
    start = time.perf_counter()
    with kvguard.guard(dd, name="dd", action="record") as g:
        dd["kl"][0].add_(1)
        dd["kl"].append(torch.ones(1))  # MARK: huge
        dd["kl"][1].add_(1)
    assert time.perf_counter() - start < 15  # linear: well under a second here
    assert calls == [] and len(dd) == 200_001
    assert _paths(g) == ["dd['kl'][0]", "dd['kl'][1]"]
    assert g.report.events[1].placed_at == _site("huge")


def test_a_deque_is_watched_for_placements() -> None:
    q: deque[torch.Tensor] = deque([torch.ones(1)])
    with kvguard.guard({"q": q}, name="rd", action="record") as g:
        q.append(torch.ones(2))
        q[1].add_(1)
    assert _paths(g) == ["rd['q'][1]"]


def test_the_ordereddict_order_does_not_force_a_rescan_at_every_write() -> None:
    od = OrderedDict(a=torch.ones(1), b=torch.ones(1))
    od.move_to_end("a")
    _, watched = _tree.walk(od, "od", lambda v: isinstance(v, torch.Tensor))
    snap = _tree.snapshot(watched)
    assert not _tree.changed(snap)
    od.move_to_end("b")
    assert not _tree.changed(snap)  # nothing new is reachable
    od["c"] = torch.ones(1)
    assert _tree.changed(snap)


@pytest.mark.parametrize("mutate, expected", [
    (lambda o: None, False),
    (lambda o: setattr(o["exp"], "kl", torch.ones(1)), True),
    (lambda o: setattr(o["exp"], "values", o["exp"].values), False),
    (lambda o: o["td"].set("new", torch.ones(2)), True),
    (lambda o: o["ns"].__dict__.pop("t"), True),
    (lambda o: setattr(o["slotted"], "kl", torch.ones(1)), True),
    (lambda o: o["q"].append(1), True),
    (lambda o: o["ud"].__setitem__("x", 1), True),
], ids=["nothing", "attr-store", "same-attr-again", "td-set", "attr-delete", "slot-store", "deque-append",
        "userdict-store"])
def test_changed_sees_stores_into_attribute_containers(check: str, mutate: Callable[[Any], None],
                                                       expected: bool) -> None:
    obj = {"exp": _experience(), "td": TensorDict({"a": torch.ones(2)}, batch_size=[2]),
           "ns": types.SimpleNamespace(t=torch.ones(1)), "slotted": Slotted(torch.ones(1)), "q": deque(),
           "ud": UserDict()}
    _, watched = _tree.walk(obj, "d", lambda v: isinstance(v, torch.Tensor))
    snap = _tree.snapshot(watched)
    mutate(obj)
    assert _tree.changed(snap) is expected


def test_no_warning_escapes_a_guard_over_every_kind() -> None:
    obj = {case.name: case.make() for case in CASES}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kvguard.guard(obj, name="obj", action="record") as g:
            for case in CASES:
                case.write(obj[case.name])
    assert len(g.report.events) == len(CASES)
    assert collections.Counter(e.kind for e in g.report.events) == {"write": len(CASES)}


# --------------------------------------------------------------------------------------------
# writes through a container library's methods name the user's line, not the library's


def _td_mul(td: Any) -> None:
    td.mul_(2)  # MARK: td-mul


def _td_update(td: Any) -> None:
    td.update_({"a": torch.ones(4, 2)})  # MARK: td-update


def _td_zero(td: Any) -> None:
    td.zero_()  # MARK: td-zero


def _td_setitem(td: Any) -> None:
    td[1:3] = TensorDict({"a": torch.ones(2, 2), "b": torch.zeros(2)}, batch_size=[2])  # MARK: td-setitem


def _td_apply(td: Any) -> None:
    td.apply_(lambda t: t.add_(1))  # MARK: td-apply


def _td_copy(td: Any) -> None:
    td.copy_(td.clone().add(1))  # MARK: td-copy


def _td_nested_fill(td: Any) -> None:
    td["sub"].fill_("c", 3.0)  # MARK: td-fill


def _td_key_write(td: Any) -> None:
    td.get("b").mul_(3)  # MARK: td-get


@pytest.mark.parametrize("write, mark, paths", [
    (_td_mul, "td-mul", ["rd['td']['a']", "rd['td']['b']", "rd['td']['sub']['c']"]),
    (_td_update, "td-update", ["rd['td']['a']"]),
    (_td_zero, "td-zero", ["rd['td']['a']", "rd['td']['b']", "rd['td']['sub']['c']"]),
    (_td_setitem, "td-setitem", ["rd['td']['a']", "rd['td']['b']"]),
    (_td_apply, "td-apply", ["rd['td']['a']", "rd['td']['b']", "rd['td']['sub']['c']"]),
    (_td_copy, "td-copy", ["rd['td']['a']", "rd['td']['b']", "rd['td']['sub']['c']"]),
    (_td_nested_fill, "td-fill", ["rd['td']['sub']['c']"]),
    (_td_key_write, "td-get", ["rd['td']['b']"]),
], ids=lambda v: v.__name__[4:] if callable(v) else None)
def test_a_write_through_a_tensordict_method_names_the_users_line(write: Callable[[Any], None], mark: str,
                                                                  paths: list[str]) -> None:
    td = TensorDict({"a": torch.zeros(4, 2), "b": torch.ones(4),
                     "sub": TensorDict({"c": torch.ones(4)}, batch_size=[4])}, batch_size=[4])
    with kvguard.guard({"td": td}, name="rd", action="record") as g:
        write(td)
    assert sorted(set(_paths(g))) == paths
    assert {f"{os.path.basename(e.filename)}:{e.lineno}" for e in g.report.events} == {_site(mark)}
    assert {e.function for e in g.report.events} == {"<lambda>" if write is _td_apply else write.__name__}


def test_a_blocked_tensordict_write_ends_its_traceback_at_the_users_line() -> None:
    td = TensorDict({"a": torch.zeros(4)}, batch_size=[4])
    with pytest.raises(kvguard.MutationError) as raised:
        with kvguard.guard({"td": td}, name="rd"):
            _td_mul(td)
    assert torch.equal(td["a"], torch.zeros(4))
    event = raised.value.args[1]
    assert f"{os.path.basename(event.filename)}:{event.lineno}" == _site("td-mul")
    last = raised.traceback[-1]
    assert (os.path.basename(str(last.path)), last.lineno + 1) == (THIS_FILE, int(_site("td-mul").split(":")[1]))


def test_a_placement_through_a_tensordict_method_is_located_at_the_users_line() -> None:
    td = TensorDict({"a": torch.zeros(4)}, batch_size=[4])
    with kvguard.guard({"td": td}, name="rd", action="record") as g:
        kl = torch.ones(4)
        td.set("kl", kl)  # MARK: td-set-kl
        td["kl"].mul_(2)
    (event,) = g.report.events
    assert event.path == "rd['td']['kl']" and event.placed_at == _site("td-set-kl")


def _library(root: Path, package: str, body: str) -> None:
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(body)


@pytest.fixture
def import_from(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path, str], Any]]:
    """Import a package from a directory, removed from `sys.modules` afterwards."""
    names: list[str] = []

    def load(root: Path, name: str) -> Any:
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.delitem(sys.modules, name, raising=False)
        names.append(name)
        import importlib

        return importlib.import_module(name)

    yield load
    for name in names:
        sys.modules.pop(name, None)


WRITER = "def scale_(tensors):\n    for t in tensors:\n        t.mul_(2)\n"


def test_an_installed_container_library_is_skipped_but_a_users_module_of_that_name_is_not(
        tmp_path: Path, import_from: Callable[[Path, str], Any]) -> None:
    _library(tmp_path / "lib" / "python3" / "site-packages", "optree", WRITER)  # installed: skipped
    _library(tmp_path / "project", "tree", WRITER)  # the user's own `tree` package: the user's code
    optree = import_from(tmp_path / "lib" / "python3" / "site-packages", "optree")
    tree = import_from(tmp_path / "project", "tree")
    x, y = torch.ones(2), torch.ones(2)
    with kvguard.guard({"x": x, "y": y}, name="rd", action="record") as g:
        optree.scale_([x])  # MARK: installed-library
        tree.scale_([y])
    sites = [(e.path, os.path.basename(e.filename), e.lineno) for e in g.report.events]
    assert sites == [("rd['x']", THIS_FILE, int(_site("installed-library").split(":")[1])),
                     ("rd['y']", "__init__.py", 3)]


def test_a_users_package_installed_in_site_packages_is_never_skipped(
        tmp_path: Path, import_from: Callable[[Path, str], Any]) -> None:
    site = tmp_path / "venv" / "lib" / "python3" / "site-packages"
    _library(site, "myrl_loss", WRITER)
    myrl_loss = import_from(site, "myrl_loss")
    x = torch.ones(2)
    with kvguard.guard({"x": x}, name="rd", action="record") as g:
        myrl_loss.scale_([x])
    (event,) = g.report.events
    assert (os.path.basename(os.path.dirname(event.filename)), event.lineno) == ("myrl_loss", 3)


def test_a_user_callback_run_by_a_container_library_is_named() -> None:
    td = TensorDict({"a": torch.zeros(2)}, batch_size=[2])

    def bump(t: torch.Tensor) -> torch.Tensor:
        return t.add_(1)  # MARK: callback

    with kvguard.guard({"td": td}, name="rd", action="record") as g:
        td.apply_(bump)
        pytree.tree_map(bump, {"a": td["a"]})  # torch's pytree: skipped as torch
    assert [f"{os.path.basename(e.filename)}:{e.lineno}" for e in g.report.events] == [_site("callback")] * 2
