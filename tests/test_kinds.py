"""Guard kinds are one object each (`kvguard._kinds`): a toy kind added here, as the checklist
in docs/architecture.md says, is switched on by its word, counted, said at exit and read back
by `kvguard report` with no other file of kvguard knowing its name."""

from __future__ import annotations

import os
from typing import Any, Collection, Iterator, Optional

import pytest
import torch

from kvguard import _config
from kvguard._activate import process_kind
from kvguard._guard.guard import Guard
from kvguard._kinds import KINDS, Kind, Moment, kind_of, register
from kvguard._report.process import PROCESS
from kvguard._state import STATE

# What the toy kind protects: every tensor a registry hands out (a stand-in for a rollout
# engine's received weights, a KV cache, anything a process keeps and others read).
REGISTRY: dict[str, torch.Tensor] = {}


class ToyGuard(Guard):
    """The toy kind's guard: a plain guard over the registry, counted under the kind's word."""

    def __init__(self, *, action: Optional[str] = "raise", allow: Optional[Collection[str]] = None,
                 target: Optional[str] = None, report_dir: Optional[str | os.PathLike[str]] = None) -> None:
        super().__init__(REGISTRY, name="REGISTRY", action=action, allow=allow, target=target, report_dir=report_dir)


TOY = Kind("toy", "every tensor the registry hands out", ("registered tensor", "registered tensors"), "protected",
           f"{__name__}:ToyGuard", moment=Moment("hand-out", "hand-outs", "over", "(none handed out)"),
           first_when=lambda moment: f", hand-out {moment}" if moment else "")
ToyGuard.kind = TOY


@pytest.fixture
def toy() -> Iterator[Kind]:
    """The toy kind registered, with the process's activation state and counts set aside."""
    remove = register(TOY)
    saved_kinds, saved_tally = dict(STATE.kinds), PROCESS.tally
    STATE.kinds.clear()
    PROCESS.tally = type(saved_tally)()
    REGISTRY.clear()
    REGISTRY.update(a=torch.zeros(3), b=torch.ones(2))
    try:
        yield TOY
    finally:
        process_kind.stop(TOY)
        STATE.kinds.clear()
        STATE.kinds.update(saved_kinds)
        PROCESS.tally = saved_tally
        remove()


def test_its_word_switches_it_on(toy: Kind) -> None:
    assert _config.from_env({"KVGUARD": "record", "KVGUARD_TARGETS": "toy"}).kinds == ("toy",)
    assert "toy" in _config.from_env({"KVGUARD": "record", "KVGUARD_TARGETS": "all"}).kinds
    with pytest.raises(_config.ConfigError, match="toy"):  # suggested among the words
        _config.from_env({"KVGUARD": "record", "KVGUARD_TARGETS": "tyo"})
    with pytest.raises(ValueError, match="exists already"):
        register(toy)


def test_it_is_started_counted_and_said_as_every_kind_is(toy: Kind) -> None:
    settings = _config.from_env({"KVGUARD": "record", "KVGUARD_TARGETS": "toy"})
    process_kind.activation_of(toy).install(toy, settings)  # torch is imported: it starts now
    guard = STATE.kinds["toy"]
    assert isinstance(guard, ToyGuard) and guard.kind is toy
    REGISTRY["a"].mul_(2)  # a stray write
    process_kind.stop(toy)
    assert "toy" not in STATE.kinds
    lines = PROCESS.tally.lines()
    assert lines[0] == "kvguard: toy: 2 registered tensors protected (none handed out), 1 write at 1 site"
    assert "test_kinds.py" in lines[1] and "REGISTRY['a']" in lines[1] and "in 1 call" not in lines[1]
    record = PROCESS.tally.as_record()["targets"]["toy"]
    assert record["protected"] == 2 and record["writes"] == 1 and record["moments"] == 0


def test_a_kind_that_never_held_a_tensor_never_says_clean(toy: Kind) -> None:
    quiet = Kind("quiet", "nothing", ("thing", "things"), "watched", f"{__name__}:ToyGuard",
                 nothing_seen="nothing was handed out here, so no write was checked",
                 never_started="the guard never started here")
    remove = register(quiet)
    try:
        PROCESS.tally.begin_call("quiet")
        assert PROCESS.tally.lines() == ["kvguard: quiet: nothing was handed out here, so no write was checked"]
        assert process_kind.exit_lines(quiet, "kvguard", counted=False) == [
            "kvguard: quiet: the guard never started here"]
        assert kind_of("quiet") is quiet and kind_of("m:f(x)") is None
    finally:
        remove()
    assert "quiet" not in KINDS


def test_the_built_in_kinds_say_what_they_said() -> None:
    """The words of the three kinds, moved into their objects, unchanged."""
    autograd, weights, data = KINDS["autograd"], KINDS["weights"], KINDS["data"]
    assert autograd.watched(1204, 12) == "1,204 saved tensors protected in 12 forward passes"
    assert weights.watched(148, 12) == "148 parameters and buffers watched over 12 optimizer steps"
    assert weights.watched(3, 0) == "3 parameters and buffers watched (no optimizer step)"
    assert data.watched(16, 0) == "16 tensors returned by datasets protected"
    assert weights.first_when(0) == ", before the first optimizer step"
    assert weights.first_when(2) == ", after optimizer step 2"
    assert autograd.first_when(3) == ", forward pass 3"


def test_guard_classes_name_their_kind() -> None:
    kinds: dict[str, Any] = {word: kind.guard_class() for word, kind in KINDS.items()}
    assert kinds["autograd"].kind is KINDS["autograd"] and kinds["data"].kind is KINDS["data"]
    assert kinds["weights"].kind is None  # guard_module() in code is counted under its name; env's under `weights`
