"""What the weights target pays for the writes it allows: batch norm's own statistics.

A module's forward updating its own buffers is intended (`ModuleSet._intended`). Per
engine: such a write is decided without the memory index or the whole stack
(`ModuleSet._own_write`), its digests read once per forward; and whatever is not that
exact case still takes the full path and is caught at its line: another module's forward
or hook, a buffer sharing a parameter's memory, a buffer swapped or moved between steps,
a change no op shows before the update would hide it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import kvguard
from kvguard._protect import records as _records
from kvguard._protect import weights as _weights

# Each engine, as `test_weights.py` runs (conftest's per-engine modules): one of them in the
# quick run, the others in the slow tier.
each_engine = pytest.mark.parametrize("engine", ("compiled", "kernels", "mode"), indirect=True)


class _Calls:
    """Counts calls of `ModuleSet._intended` (the full path's stack walk) and of `records.describe`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.intended = 0
        self.described = 0
        intended, describe = _weights.ModuleSet._intended, _records.describe

        def counting_intended(set_: Any, *args: Any) -> Any:
            self.intended += 1
            return intended(set_, *args)

        def counting_describe(*args: Any) -> Any:
            self.described += 1
            return describe(*args)
        monkeypatch.setattr(_weights.ModuleSet, "_intended", counting_intended)
        monkeypatch.setattr(_records, "describe", counting_describe)


def _net(n: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(n):
        layers += [torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)]
    return torch.nn.Sequential(*layers)


@each_engine
def test_batch_norms_own_statistics_take_no_full_path_and_one_read_per_forward(
        engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _net(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        model(x).sum().backward()
        opt.step()
        calls = _Calls(monkeypatch)
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        assert calls.intended == 0  # 2 forwards x 3 batch norms x 2 writes, none through the stack walk
        calls.described = 0
        with torch.no_grad():
            model(x)
            model(x)
        # One description per batch norm forward (its 3 buffers checked, the previous one's taken
        # again), none for its second write.
        assert calls.described == 2 * 3 and calls.intended == 0
    assert g.report.ok, g.report.format()
    assert int(model[1].num_batches_tracked) == 5


@each_engine
def test_a_batch_norm_buffer_written_by_another_modules_forward_is_stopped_at_its_line(engine: str) -> None:
    class Meddler(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.bn(x)  # its own update: intended
            self.bn.running_mean.mul_(0.5)  # the parent's forward writing the child's buffer
            return y

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Meddler())
    with kvguard.guard_module(model, action="raise") as g:
        with pytest.raises(kvguard.MutationError) as caught:
            model(torch.randn(8, 4))
    event = caught.value.event
    assert (event.path, event.op) == ("model.1.bn.running_mean", "aten.mul_.Tensor")
    assert event.code == "self.bn.running_mean.mul_(0.5)  # the parent's forward writing the child's buffer"
    assert len(g.report.events) == 1


@each_engine
def test_a_forward_hook_of_another_module_writing_batch_norms_buffer_is_stopped(engine: str) -> None:
    model = _net(2)
    bn = model[1]

    def hook(module: Any, args: Any, out: Any) -> None:
        bn.running_var.fill_(1.0)  # a hook of the next Linear writing the batch norm's buffer

    model[2].register_forward_hook(hook)
    with pytest.raises(kvguard.MutationError) as caught:  # (torch's hook call has an `except Exception`)
        with kvguard.guard_module(model, action="raise"):
            model(torch.randn(8, 4))
    assert caught.value.event.path == "model.1.running_var"
    assert caught.value.event.code.startswith("bn.running_var.fill_(1.0)")


@each_engine
def test_a_buffer_shared_by_two_batch_norms_is_each_ones_own_and_a_third_writer_is_stopped(engine: str) -> None:
    model = _net(2)
    shared = model[1].running_mean
    model[3].running_mean = shared  # the same tensor, a buffer of both
    with kvguard.guard_module(model, action="raise") as g:
        model(torch.randn(8, 4))
        model(torch.randn(8, 4))
        assert g.report.ok, g.report.format()
        with pytest.raises(kvguard.MutationError) as caught:
            with torch.no_grad():
                model[3].running_mean.add_(1.0)  # not in a forward
    assert caught.value.event.path in ("model.1.running_mean", "model.3.running_mean")


@each_engine
def test_a_batch_norm_buffer_that_shares_a_weights_memory_reports_the_weight(engine: str) -> None:
    """Its memory is not its own: its module's update writes the Linear's weight too."""
    model = _net(1)
    model[1].running_mean = model[0].weight.detach()[0]  # a view of the Linear's first row
    with kvguard.guard_module(model, action="raise"):
        with pytest.raises(kvguard.MutationError) as caught:
            model(torch.randn(8, 4))
    assert caught.value.event.path == "model.0.weight"


@each_engine
def test_a_buffer_swapped_between_steps_is_protected_from_the_next_check(engine: str) -> None:
    model = _net(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        for i in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                model[1].running_mean = torch.zeros(4)  # the old one freed: its id may come back
                model[3].register_buffer("running_var", torch.ones(4))
            if i == 1:
                g.check()
        assert g.report.ok, g.report.format()
        with pytest.raises(kvguard.MutationError) as caught:
            model[1].running_mean.add_(1.0)
    assert caught.value.event.path == "model.1.running_mean"


@each_engine
def test_a_buffer_moved_with_no_op_is_followed_and_still_guarded(engine: str) -> None:
    model = _net(2)
    x = torch.randn(8, 4)
    with kvguard.guard_module(model, action="raise") as g:
        model(x)
        model[1].running_mean.share_memory_()  # new memory, same tensor, no op dispatched
        model(x)
        model(x)
        assert g.report.ok, g.report.format()
        with pytest.raises(kvguard.MutationError) as caught:
            model[1].running_mean.zero_()
    assert caught.value.event.path == "model.1.running_mean"


def test_a_hidden_change_before_a_forward_is_found_when_its_update_would_hide_it() -> None:
    """Level full, two batch norms: the first's statistics change through numpy after the
    second's forward took its digests back; the first's next forward checks before it updates."""
    model = _net(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        for i in range(3):
            model(x).sum().backward()
            if i == 1:
                model[1].running_var.detach().numpy()[:] = 7.0  # no op: hidden from the hook
            opt.step()
            opt.zero_grad()
    assert [(e.path, e.kind) for e in g.report.events] == [("model.1.running_var", "unobserved")]


def test_a_hidden_change_between_a_forward_and_the_next_is_found_there() -> None:
    model = _net(2)
    x = torch.randn(8, 4)
    with kvguard.guard_module(model, action="record") as g:
        model(x)
        model(x)  # the first batch norm's update is settled by the second's forward
        model[1].running_mean.detach().numpy()[:] = 3.0
        model(x)
    assert [(e.path, e.kind) for e in g.report.events] == [("model.1.running_mean", "unobserved")]


@each_engine
def test_own_buffers_are_judged_the_same_in_eval_and_without_running_statistics(engine: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, track_running_stats=False),
                                torch.nn.BatchNorm1d(4))
    x = torch.randn(8, 4)
    with kvguard.guard_module(model, action="raise") as g:
        model(x)
        model.eval()
        model(x)
        model.train()
        model(x)
    assert g.report.ok, g.report.format()


@pytest.mark.slow
def test_the_first_guard_of_a_process_reads_records_in_cpp() -> None:
    """`guard_module` made before any other guard loaded the compiled extension: its set reads
    its records in C++ (it once read them in Python for its whole life, ~2x a batch norm write)."""
    code = (
        "import torch, kvguard\n"
        "m = torch.nn.BatchNorm1d(3)\n"
        "with kvguard.guard_module(m) as g:\n"
        "    m(torch.randn(4, 3))\n"
        "    print(g.engine, g._protected._compiled is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "KVGUARD_ENGINE": "compiled"})
    assert out.returncode == 0, out.stderr
    engine, compiled = out.stdout.split()
    assert compiled == ("True" if engine == "compiled" else "False")
