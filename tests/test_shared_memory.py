"""One memory under two paths, and one op reading what it writes (issue 37, items 4-6).

A guarded container holding the same memory under two paths names the other path in the
first line of every report and in the site's exit line; a reduction that reaches that
memory a second time in one guarded call (`for v in metrics.values(): dist.all_reduce(v)`)
is its own kind, `reduced_twice`, reported even under an `allow=` of the path. An op whose
read arguments overlap the memory it writes, shifted (`x[:, 1:].copy_(x[:, :-1])`), is
`self_overlap`. Asynchronous collectives' reports read the values once the collective has
completed (at `wait()`), on two real gloo processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import kvguard
from kvguard._report.tally import Tally
from tests.processes import free_port


def _kinds(report: Any) -> list[tuple[str, str]]:
    return [(e.path, e.kind) for e in report.events]


def test_one_tensor_under_two_keys_reduced_twice_is_loud(engine: str) -> None:
    acc = torch.ones(3)
    metrics = {"acc": acc, "acc_copy": acc}
    with kvguard.guard(metrics, name="metrics", action="record") as g:
        for v in metrics.values():
            v.mul_(2)  # two keys, one tensor: doubled twice
    assert _kinds(g.report) == [("metrics['acc']", "write"), ("metrics['acc']", "reduced_twice")]
    first, second = g.report.events
    assert first.headline().startswith("metrics['acc'] (the same memory as metrics['acc_copy']) was modified")
    assert "reduced in place a second time by aten.mul_.Tensor" in second.headline()
    assert "held under 2 paths (metrics['acc'], metrics['acc_copy'])" in second.diff
    assert second.before == "[2, 2, 2]" and second.after == "[4, 4, 4]"
    tally = Tally()
    for event in g.report.events:
        tally.add(event, 1, "metrics")
    (line,) = [line for line in tally.lines() if "aten.mul_" in line]
    assert "(first: metrics['acc'], call 1; the same memory as metrics['acc_copy']; 1 reduced twice" in line


def test_a_loop_over_distinct_memory_is_no_reduced_twice(engine: str) -> None:
    metrics = {"acc": torch.ones(3), "loss": torch.ones(3)}
    with kvguard.guard(metrics, name="metrics", action="record") as g:
        for v in metrics.values():
            v.mul_(2)
        metrics["acc"].fill_(0)
        metrics["acc"].fill_(0)  # an overwrite twice is no reduction
    assert [e.kind for e in g.report.events] == ["write"] * 4
    assert all(not e.aliases for e in g.report.events)


def test_a_repeated_update_of_memory_with_a_view_elsewhere_is_no_reduced_twice(engine: str) -> None:
    s = torch.arange(16.0).reshape(4, 4)
    state = {"s": s, "top": torch.split(s, 2)[0]}  # two tensors, one memory: not one tensor twice
    with kvguard.guard(state, name="state", action="record", allow=["state['s']", "state['top']"]) as g:
        for _ in range(3):
            s.mul_(0.5)  # a decay applied three times, at one line
    assert g.report.events == []  # allowed, and no reduction reached the memory through a second path


def test_batch_norm_writing_two_statistics_names_no_shared_memory(engine: str) -> None:
    bn = torch.nn.BatchNorm1d(3)
    with kvguard.guard({"rm": bn.running_mean, "rv": bn.running_var}, name="stats", action="record") as g:
        bn(torch.randn(8, 3))
    assert [(e.path, e.kind, e.aliases) for e in g.report.events] == [
        ("stats['rm']", "write", ()), ("stats['rv']", "write", ())]


def test_two_tensors_of_one_memory_name_each_other(engine: str) -> None:
    t = torch.zeros(2, 3)
    data = {"acc": t, "flat": t.view(6)}
    with kvguard.guard(data, name="data", action="record") as g:
        t.add_(1)
    assert sorted((e.path, e.aliases) for e in g.report.events) == [
        ("data['acc']", ("data['flat']",)), ("data['flat']", ("data['acc']",))]


def test_reduced_twice_is_reported_where_the_writes_are_allowed(engine: str) -> None:
    acc = torch.ones(3)
    metrics = {"acc": acc, "acc_copy": acc}
    with kvguard.guard(metrics, name="metrics", action="raise", allow=["metrics['acc']", "metrics['acc_copy']"]):
        metrics["acc"].add_(1)  # allowed
        with pytest.raises(kvguard.MutationError, match=r"would be reduced in place a second time") as info:
            for v in metrics.values():
                v.add_(1)
    assert info.value.event.kind == "reduced_twice" and info.value.event.blocked
    assert torch.equal(acc, torch.full((3,), 3.0))  # 1, +1 allowed, +1 by the loop (allowed), the second stopped


def test_a_shifted_copy_from_itself_is_self_overlap(engine: str) -> None:
    sample = {"action": torch.arange(2 * 64.0).reshape(2, 64)}
    data = sample["action"][:, 1:]
    with kvguard.guard(sample, name="sample", action="record") as g:
        data.copy_(sample["action"][:, :-1])  # the replay buffer's shifted set_
    (event,) = g.report.events
    assert (event.kind, event.lineno) == ("self_overlap", sys._getframe().f_lineno - 2)
    assert "which reads memory it writes" in event.headline()
    assert "f32[2, 63] cpu at element 0 of its storage" in event.diff
    assert "f32[2, 63] cpu at element 1 of its storage" in event.diff


def test_the_fixed_copy_from_a_clone_is_an_ordinary_write(engine: str) -> None:
    sample = {"action": torch.arange(2 * 64.0).reshape(2, 64)}
    data = sample["action"][:, 1:]
    with kvguard.guard(sample, name="sample", action="record") as g:
        data.copy_(sample["action"][:, :-1].clone())
        sample["action"].add_(sample["action"])  # reads each element where it writes it
    assert [e.kind for e in g.report.events] == ["write", "write"]


def test_index_copy_from_its_own_view_is_self_overlap_and_stopped(engine: str) -> None:
    x = torch.arange(8.0)
    with pytest.raises(kvguard.MutationError, match=r"would be modified in place by aten.index_copy_"):
        with kvguard.guard({"x": x}, name="rd", action="raise"):
            x.index_copy_(0, torch.tensor([1, 2, 3]), x[:3])
    assert torch.equal(x, torch.arange(8.0))  # stopped before it ran


def test_self_overlap_is_reported_where_the_path_is_allowed(engine: str) -> None:
    x = torch.arange(16.0).reshape(2, 8)
    with kvguard.guard({"x": x}, name="rd", action="record", allow=["rd['x']"]) as g:
        x[:, 1:].copy_(x[:, :-1])
        x[:, 1:].copy_(x[:, :-1].clone())  # allowed: the path may be written
    assert [e.kind for e in g.report.events] == ["self_overlap"]
    assert sum(g.report.allowed.values()) == 1


def test_a_collective_never_waited_for_is_reported_at_the_boundary(tmp_path: Any, engine: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        t = torch.full((2,), 3.0)
        with kvguard.guard({"t": t}, name="rd", action="record") as g:
            work = dist.all_reduce(t, async_op=True)
            assert g.report.events == []  # pending: not reported before it completes
            g.check()
        (event,) = g.report.events
        assert (event.path, event.kind, event.op) == ("rd['t']", "write", "c10d.allreduce_.default")
        assert "with no wait() of the collective seen before" in event.diff
        work.wait()
        assert len(g.report.events) == 1  # reported once
    finally:
        dist.destroy_process_group()


TWO_RANKS = """
import json, os, sys, time, warnings, torch, torch.distributed as dist, kvguard

def main(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {"rank": rank}
    acc = torch.tensor([0.5 + rank])
    metrics = {"acc": acc, "acc_copy": acc, "loss": torch.tensor([1.0])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kvguard.guard(metrics, name="metrics", action="warn") as g:
            for v in metrics.values():
                dist.all_reduce(v)
    out["sync"] = [(e.path, e.kind, e.before, e.after, e.diff) for e in g.report.events]
    out["acc"] = acc.tolist()
    t = torch.tensor([0.25 + rank])
    with kvguard.guard({"t": t}, name="rd", action="record") as g:
        work = dist.all_reduce(t, async_op=True)
        pending = len(g.report.events)
        work.wait()
    out["async"] = [(e.path, e.kind, e.before, e.after, e.diff) for e in g.report.events]
    out["pending_before_wait"] = pending
    big = torch.full((1_000_000,), float(rank + 1))
    rd = {}
    with kvguard.guard(rd, name="rd", action="record") as g:
        if rank == 1:
            time.sleep(0.3)  # rank 0's collective is still running when it places and looks
        work = dist.all_reduce(big, async_op=True)
        rd["sum"] = big  # placed before the collective completed: not a change to what was placed
        torch.zeros(1).add_(1)  # a look
        work.wait()
        dist.all_reduce(rd["sum"])  # a collective after the placement: a write to it
    out["in_flight"] = [(e.path, e.kind) for e in g.report.events]
    sys.stdout.write(json.dumps(out) + "\\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch's gloo teardown at exit aborts now and then (see test_fingerprints)

if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=(int(sys.argv[1]),), nprocs=2)
"""


def test_collectives_on_two_gloo_processes(tmp_path: Any, engine: str) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env.update(OMP_NUM_THREADS="1", KVGUARD_ENGINE=os.environ.get("KVGUARD_ENGINE", "auto"))
    result = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True,
                            timeout=180, env=env)
    assert result.returncode == 0, result.stderr
    ranks = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                   key=lambda r: r["rank"])
    assert len(ranks) == 2
    for r in ranks:
        # acc (0.5 on rank 0, 1.5 on rank 1) is summed twice: 2.0, then 4.0 on both ranks
        assert r["acc"] == [4.0]
        (acc1, acc2, loss) = r["sync"]  # in the dict's order: acc, acc_copy, loss
        assert (acc1[:2], acc2[:2], loss[:2]) == (["metrics['acc']", "write"], ["metrics['acc']", "reduced_twice"],
                                                  ["metrics['loss']", "write"])
        assert (acc1[2], acc1[3]) == ([f"[{0.5 + r['rank']}]"][0], "[2]"), acc1  # the completed value
        assert (acc2[2], acc2[3]) == ("[2]", "[4]") and "identical" not in acc2[4]
        assert "held under 2 paths (metrics['acc'], metrics['acc_copy'])" in acc2[4]
        ((path, kind, before, after, diff),) = r["async"]
        assert (path, kind, before, after) == ("rd['t']", "write", f"[{0.25 + r['rank']}]", "[1.5]")
        assert r["pending_before_wait"] == 0
        assert r["in_flight"] == [["rd['sum']", "write"]]  # the collective after the placement alone
    assert result.stderr.count("was reduced in place a second time by") == 2, result.stderr  # a panel per rank
    assert "the same memory as metrics['acc_copy']" in result.stderr
