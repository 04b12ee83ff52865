"""Placements while a guard is active: each one is looked at where it happened, at a cost
in proportion to what was placed, and reports still name every path to a tensor.

A placement walks only what is new in the container that changed; a container that lost
a nested one is walked again whole, so nothing unreachable stays held.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref
from collections import deque
from typing import Any

import pytest
import torch

import kvguard


def _paths(g: Any) -> list[str]:
    return [e.path for e in g.report.events]


def test_a_tensor_placed_under_a_second_key_is_named_as_an_alias() -> None:
    k = torch.ones(4)
    rd: dict[str, Any] = {"kl": [k], "other": []}
    with kvguard.guard(rd, name="rd", action="record") as g:
        rd["other"].append(k)  # the same tensor, now reachable twice
        k.mul_(2)
    (event,) = g.report.events
    assert {event.path, *event.aliases} == {"rd['kl'][0]", "rd['other'][0]"}
    assert not event.detached


def test_a_tensor_removed_from_the_dict_then_written_is_reported_as_detached() -> None:
    k = torch.ones(4)
    rd: dict[str, Any] = {"kl": [k]}
    with kvguard.guard(rd, name="rd", action="record") as g:
        rd["kl"].append(torch.zeros(1))
        rd["kl"].pop(0)  # no longer reachable from rd
        k.add_(1)
    (event,) = g.report.events
    assert event.path == "rd['kl'][0]" and event.detached


def test_a_replaced_container_is_let_go() -> None:
    old = {"kl": torch.ones(1000)}
    rd: dict[str, Any] = {"batch": old}
    tmp = torch.zeros(1)
    gone = weakref.ref(old["kl"])  # its memory: a GPU batch must be freed when replaced
    with kvguard.guard(rd, name="rd", action="record") as g:
        rd["batch"] = {"kl": torch.ones(3)}
        del old
        tmp.add_(1)  # a write op: the placement is looked at
        gc.collect()
        assert gone() is None, "the guard keeps what left the guarded object alive"
        rd["batch"]["kl"].mul_(2)
    assert _paths(g) == ["rd['batch']['kl']"]


@dataclasses.dataclass
class Experience:
    kl: Any = None
    values: Any = None


def test_placements_into_every_kind_of_container_are_protected() -> None:
    exp = Experience(kl=torch.ones(2))
    q: deque[torch.Tensor] = deque()
    rd: dict[str, Any] = {"exp": exp, "q": q, "nested": {"a": [torch.ones(1)]}, "tup": (torch.ones(1),)}
    with kvguard.guard(rd, name="rd", action="record") as g:
        exp.values = torch.ones(3)
        q.append(torch.ones(2))
        rd["nested"]["a"].append(torch.ones(1))
        rd["nested"]["b"] = {"deep": [torch.ones(1)]}
        rd["tup"] = (torch.ones(1), torch.ones(2))
        exp.values.add_(1)
        q[0].add_(1)
        rd["nested"]["a"][1].add_(1)
        rd["nested"]["b"]["deep"][0].add_(1)
        rd["tup"][1].add_(1)
    assert _paths(g) == ["rd['exp'].values", "rd['q'][0]", "rd['nested']['a'][1]",
                         "rd['nested']['b']['deep'][0]", "rd['tup'][1]"]


def test_top_level_filters_hold_for_placements() -> None:
    rd: dict[str, Any] = {"kl": torch.ones(1)}
    with kvguard.guard(rd, name="rd", action="record", keys=["kl", "adv"], ignore=["adv"]) as g:
        rd["adv"] = torch.ones(1)
        rd["log"] = torch.ones(1)
        rd["kl2"] = rd["kl"]
        rd["adv"].add_(1)
        rd["log"].add_(1)
        rd["kl"].add_(1)
    assert _paths(g) == ["rd['kl']"]
    assert g.keys_seen >= {"kl", "adv", "log", "kl2"}


def test_a_deletion_then_a_store_is_seen() -> None:
    rd: dict[str, Any] = {"a": torch.ones(1), "b": torch.ones(1), "c": torch.ones(1)}
    with kvguard.guard(rd, name="rd", action="record") as g:
        del rd["a"]
        rd["d"] = torch.ones(1)
        rd["lst"] = [torch.ones(1)]
        rd["lst"].insert(0, torch.ones(2))
        rd["d"].add_(1)
        rd["lst"][0].add_(1)
    assert _paths(g) == ["rd['d']", "rd['lst'][0]"]


def _placements_per_second(protected: int, placements: int) -> float:
    rd = {f"k{i}": [torch.ones(4) for _ in range(protected // 6)] for i in range(6)}
    rd["new"] = []  # type: ignore[assignment]
    tmp = torch.zeros(1)
    with kvguard.guard(rd, name="rd", action="raise"):
        start = time.process_time()
        for _ in range(placements):
            rd["new"].append(torch.ones(4))
            tmp.add_(1)  # a write op: each placement is looked at before it
        took = time.process_time() - start
    return placements / took


def test_a_placement_costs_the_same_late_as_early() -> None:
    """An append loop is linear: the 2,000th placement costs what the 1st did (once the whole
    dict was walked again per placement: quadratic, 26 ms each at 2,000 tensors)."""
    early = _placements_per_second(3000, 200)
    late = _placements_per_second(3000, 2000)
    assert late > early / 3, (early, late)
    assert late > 2000, f"{late:.0f} placements/s with 3,000 protected tensors"
