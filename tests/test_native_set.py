"""The protected set kept in C++ (`kvguard._protect.native.NativeSet`, `write_hook.Table`): what
the compiled engine's guards keep, and that it stays in proportion to what is alive.

The per-engine modules (test_guard, test_containers, test_property, ...) check what every
guard reports under the compiled engine, and so through this set; these tests check what
only this set does: rows in C++, runs of list tensors, sweeping and renumbering rows in a
long guard, segments of the watch.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
import torch

import kvguard
from kvguard._protect.native import NativeSet

pytestmark = pytest.mark.parametrize("engine", ["compiled"], indirect=True)


def _set(g: Any) -> NativeSet:
    protected = g._protected
    assert isinstance(protected, NativeSet), type(protected)
    return protected


def test_a_long_guard_keeps_rows_in_proportion_to_what_is_alive(engine: str) -> None:
    rd: dict[str, Any] = {"x": torch.zeros(4), "keep": [torch.ones(2) for _ in range(10)]}
    with kvguard.guard(rd, name="rd", action="record") as g:
        protected = _set(g)
        rd["keep"][3].add_(1)  # an entry made before the rows are renumbered
        for _ in range(6000):
            rd["x"] = torch.zeros(4)  # placed, and the tensor before it dies
            torch.zeros(1).add_(1)  # a write: the guard looks
        rows = len(protected._table)
        rd["keep"][3].add_(1)
        rd["x"].add_(1)
    assert rows < 3000, f"{rows} rows for 11 live tensors after 6,000 placements"
    assert [e.path for e in g.report.events] == ["rd['keep'][3]", "rd['keep'][3]", "rd['x']"]


def test_the_guard_keeps_no_tensor_alive(engine: str) -> None:
    rd: dict[str, Any] = {"a": [torch.zeros(8) for _ in range(4)], "b": torch.ones(3)}
    gone = weakref.ref(rd["a"][2])
    with kvguard.guard(rd, action="raise") as g:
        rd["a"][2].add_(0) if False else None
        del rd["a"][2]
        torch.zeros(1).add_(1)
        gc.collect()
        assert gone() is None  # no reference of the table's kept it
        with pytest.raises(kvguard.MutationError):
            rd["b"].mul_(2)
    assert g.report.events[0].path == "rd['b']"


def test_a_tensor_in_a_list_twice_is_reported_with_its_other_path(engine: str) -> None:
    t = torch.zeros(3)
    rd = {"a": [t, torch.ones(2), t]}
    with kvguard.guard(rd, name="rd", action="record") as g:
        t.add_(1)
    (event,) = g.report.events
    assert event.path == "rd['a'][0]" and event.aliases == ("rd['a'][2]",)


def test_runs_and_leaves_mixed_in_one_object_have_their_paths(engine: str) -> None:
    rd: dict[str, Any] = {"runs": [torch.zeros(2) for _ in range(300)], "mixed": [torch.zeros(2), 3, "x"],
                          "deep": {"inner": [torch.zeros(1) for _ in range(3)]}}
    with kvguard.guard(rd, name="rd", action="record") as g:
        rd["runs"][299].add_(1)
        rd["mixed"][0].add_(1)
        rd["deep"]["inner"][2].add_(1)
        line = sys._getframe().f_lineno + 1
        rd["placed"] = [torch.zeros(1) for _ in range(5)]
        rd["placed"][4].add_(1)
    assert [(e.path, e.placed_at) for e in g.report.events] == [
        ("rd['runs'][299]", None), ("rd['mixed'][0]", None), ("rd['deep']['inner'][2]", None),
        ("rd['placed'][4]", f"test_native_set.py:{line}")]


def test_a_placement_takes_a_new_snapshot_of_what_it_changed_only(engine: str) -> None:
    rd: dict[str, Any] = {"big": [torch.zeros(1) for _ in range(2000)], "other": [torch.zeros(1) for _ in range(900)]}
    with kvguard.guard(rd, action="raise") as g:
        watcher = _set(g)._watcher
        before = list(watcher.segments)
        rd["new"] = torch.zeros(2)  # into the small dict: only its segment is taken again
        torch.zeros(1).add_(1)
        after = watcher.segments
        big = [s for s in before if any(c is rd["big"] for c in s.containers)]
        assert big and any(s is big[0] for s in after)
        with pytest.raises(kvguard.MutationError):
            rd["new"].add_(1)


def test_the_table_lets_a_dead_tensor_go_and_says_its_memory_was_met(engine: str) -> None:
    from kvguard._protect.native import table_module

    kvguard.guard({"warm": torch.zeros(1)}).__enter__().__exit__(None, None, None)  # loads the extension
    module = table_module()
    assert module is not None
    table = module.Table((torch.Tensor, torch.nn.Parameter), True)
    kept, doomed = torch.arange(8.0), torch.zeros(16)
    first, again, python = table.add([kept, doomed, kept])
    assert (first, again, python) == (0, [(2, 0)], [])  # the second path to `kept` takes no row
    start, stop = doomed.data_ptr(), doomed.data_ptr() + 64
    assert table.meeting(start, stop, doomed.device) == [1]
    del doomed
    gc.collect()
    assert table.tensor(1) is None
    assert table.meeting(start, stop, torch.device("cpu")) == [] and table.met_dead()
    assert table.sweep() == [1] and table.live() == 1
    assert table.compact() == [0] and len(table) == 1 and table.tensor(0) is kept
    changed, moved, _ = table.refresh()
    assert changed == [] and moved == []
    kept.add_(1)  # no hook here: the digest finds it
    changed, _, _ = table.refresh()
    assert [row for row, _, _ in changed] == [0]
