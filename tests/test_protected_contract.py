"""Every protected set meets the written contract (`kvguard._protect.contract.Protected`).

mypy checks the types (each set's module ends with the check); this test checks what mypy
cannot see from outside the package: that each set, as made at run time, has every
member, that its methods take the contract's parameters (names, kinds, defaults), and that
the compiled hook builds the one record type (`records.Record`) Python builds.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest
import torch

from kvguard._native import build as _build
from kvguard._protect import records as _records
from kvguard._protect.contract import Capabilities, Protected
from kvguard._protect.native import NativeSet
from kvguard._protect.protected import ProtectedSet
from kvguard._protect.queued import QueuedSet
from kvguard._protect.samples import SampleSet
from kvguard._protect.saved import SavedSet
from kvguard._protect.weights import ModuleSet

COMPILED = _build.load()
needs_compiled = pytest.mark.skipif(COMPILED is None, reason=f"no compiled extension here: {_build.reason()}")


def _members() -> dict[str, Any]:
    """The contract's members by name: its methods and properties, and its annotated attributes."""
    found: dict[str, Any] = {name: None for name in Protected.__annotations__}
    found.update((name, value) for name, value in vars(Protected).items() if not name.startswith("_"))
    return found


MEMBERS = _members()


def _native() -> NativeSet:
    _records.compiled_describe()
    return NativeSet({"x": torch.zeros(2)}, "rd", None, ())


SETS: list[tuple[str, Callable[[], Any]]] = [
    ("ProtectedSet", lambda: ProtectedSet({"x": torch.zeros(2)}, "rd", None, ())),
    ("NativeSet", _native),
    ("SavedSet", lambda: SavedSet("autograd")),
    ("SampleSet", lambda: SampleSet("data")),
    ("ModuleSet", lambda: ModuleSet([("model", torch.nn.Linear(2, 2))])),
]


def _made(make: Callable[[], Any]) -> Any:
    if make is _native and COMPILED is None:
        pytest.skip(f"no compiled extension here: {_build.reason()}")
    return make()


def test_the_contract_names_what_the_guard_the_judge_and_the_engines_use() -> None:
    assert {"written_entries", "publish", "boundary_changes", "values_only", "holds_weights", "unprotected",
            "graphs", "steps", "on_index", "final", "attach_backend", "attach_hook", "findings"} <= set(MEMBERS)
    # Each capability has a plain guard's answer in `Capabilities`, and is a read-only member of the contract.
    for name in ("judges_uncounted", "values_only", "holds_weights", "counter_only", "graphs", "steps", "unprotected",
                 "buffer_count"):
        assert hasattr(Capabilities, name) and isinstance(MEMBERS[name], property), name


@pytest.mark.parametrize("make", [m for _, m in SETS], ids=[n for n, _ in SETS])
def test_each_set_has_every_member(make: Callable[[], Any]) -> None:
    protected = _made(make)
    try:
        missing = [name for name in MEMBERS if not hasattr(protected, name)]
        assert not missing, f"{type(protected).__name__} lacks {missing}"
        for name, member in MEMBERS.items():
            value = getattr(protected, name)
            if isinstance(member, property):
                assert not callable(value), f"{type(protected).__name__}.{name} is a method, not a value"
            elif member is not None:
                assert callable(value), f"{type(protected).__name__}.{name} is not a method"
    finally:
        protected.close()


@pytest.mark.parametrize("cls", [ProtectedSet, NativeSet, QueuedSet, SavedSet, SampleSet, ModuleSet],
                         ids=lambda c: c.__name__)
def test_each_set_takes_the_contracts_parameters(cls: type) -> None:
    for name, member in MEMBERS.items():
        if member is None or isinstance(member, property):
            continue
        want = inspect.signature(member).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        assert [(p.name, p.kind, p.default) for p in got.values()] == [
            (p.name, p.kind, p.default) for p in want.values()], f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))}"


def test_capabilities_say_what_a_set_is() -> None:
    """The judge and the guard ask these, never the class."""
    plain = ProtectedSet({"x": torch.zeros(2)}, "rd", None, ())
    saved, weights = SavedSet("autograd"), ModuleSet([("model", torch.nn.Linear(2, 2))])
    try:
        assert (plain.values_only, plain.holds_weights, plain.judges_uncounted) == (False, False, True)
        assert (saved.values_only, saved.holds_weights, saved.judges_uncounted) == (True, False, False)
        assert (weights.values_only, weights.holds_weights, weights.judges_uncounted) == (False, True, True)
        assert plain.graphs == plain.steps == plain.unprotected == 0
    finally:
        for protected in (plain, saved, weights):
            protected.close()


@needs_compiled
def test_cpp_and_python_build_the_one_record_type() -> None:
    assert COMPILED.RECORD_FIELDS == _records.Record._fields
    tensor = torch.arange(6.0)
    (fast,) = _records.describe([tensor], True, COMPILED)
    (slow,) = _records.describe([tensor], True, None)
    assert type(fast) is type(slow) is _records.Record
    assert type(fast.start) is type(slow.start) is int  # START is an int on both sides
    assert fast.spans is None and slow.spans is not None and slow.device is None
    assert _records.intervals([fast]) == _records.intervals([slow]) == [(tensor.data_ptr(), tensor.data_ptr() + 24)]
    table = COMPILED.Table((torch.Tensor,), True)
    try:
        table.add([tensor])
        assert type(table.record(0)) is _records.Record and table.record(0)[:_records.DIGEST] == fast[:_records.DIGEST]
    finally:
        table.clear()


@needs_compiled
def test_the_hook_refuses_a_record_type_of_other_fields() -> None:
    from typing import NamedTuple

    class Shuffled(NamedTuple):
        impl: int
        layout: int

    with pytest.raises(TypeError, match="RECORD_FIELDS"):
        COMPILED.set_record_type(Shuffled)
    with pytest.raises(TypeError):
        COMPILED.set_record_type(tuple)
    _records.compiled_describe()  # still bound to Record
    assert type(_records.describe([torch.ones(1)], False, COMPILED)[0]) is _records.Record


@needs_compiled
def test_row_flags_are_the_hooks_own() -> None:
    flags = [getattr(COMPILED, name) for name in dir(COMPILED) if name.startswith("ROW_")]
    assert len(flags) == len(set(flags)) == 7 and all(f and f & (f - 1) == 0 for f in flags)
    table = COMPILED.Table((torch.Tensor,), True)
    try:
        table.add([torch.zeros(3), torch.zeros(3, 3).to_sparse()])
        assert not table.flags(0) & COMPILED.ROW_PYTHON and table.flags(1) & COMPILED.ROW_PYTHON
        table.set_flag(0, COMPILED.ROW_EXPLAINED, True)
        assert table.flags(0) & COMPILED.ROW_EXPLAINED
    finally:
        table.clear()
