"""Writes the schema does not declare: BatchNorm's running statistics and the sweep that pins them.

`aten::native_batch_norm` (and a few more, `kvguard._torch.ops._UNDECLARED_WRITES`) updates
`running_mean`/`running_var` without a `!` in its schema. The guard must still catch `bn(x)`
at the op, and `tools/sweep_undeclared_writes.py` must notice when a torch version adds
another such op: a CI-sized subset of its sweep runs here and fails on any write missing
from the table.

Lines that tests point at carry a ``# MARK: name`` comment (`_line("name")` finds them).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import kvguard
from kvguard._torch import ops as kv_torch

ROOT = Path(__file__).resolve().parent.parent
THIS_FILE = os.path.basename(__file__)
_SOURCE = Path(__file__).read_text().splitlines()


def _line(mark: str) -> int:
    hits = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# MARK: {mark}")]
    assert len(hits) == 1, f"marker {mark!r} found {len(hits)} times"
    return hits[0]


def _load_sweep() -> Any:
    name = "sweep_undeclared_writes"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sweep = _load_sweep()


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A copy of the table the test may edit; op facts are relearned before and after."""
    edited = dict(kv_torch._UNDECLARED_WRITES)
    monkeypatch.setattr(kv_torch, "_UNDECLARED_WRITES", edited)
    kv_torch._facts_cache.clear()  # the dispatch mode holds this very dict
    yield edited
    monkeypatch.undo()
    kv_torch._facts_cache.clear()


# ---------------------------------------------------------------------------------------
# The pinned sweep

# Every normalization entry point that can touch running statistics, plus what else writes
# an undeclared argument on CPU (LSTM's backward), plus every 40th op_db entry.
NORMALIZATION = [
    "nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d",
    "nn.InstanceNorm1d", "nn.InstanceNorm2d", "nn.InstanceNorm3d",
    "nn.functional.batch_norm", "nn.functional.batch_norm.without_cudnn", "nn.functional.instance_norm",
    "native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
    "extra:torch.batch_norm.*", "extra:torch.instance_norm.*", "extra:aten.*", "extra:nn.SyncBatchNorm.eval",
]
OTHERS = ["nn.LSTM"]
SAMPLE_STRIDE = 40


@pytest.fixture(scope="module")
def subset_cases() -> Any:
    cases = sweep.select_cases(NORMALIZATION + OTHERS)
    names = {c.name for c in cases}
    cases += [c for c in sweep.select_cases(sources=["op_db"], stride=SAMPLE_STRIDE) if c.name not in names]
    return cases


@pytest.fixture(scope="module")
def subset(subset_cases: Any) -> Any:
    cases = subset_cases
    start = time.process_time()  # CPU seconds: the machine running CI may be shared
    result = sweep.run_sweep(cases, sweep.Options(backward=True))
    result.cpu_seconds = time.process_time() - start
    return cases, result


def test_subset_covers_the_normalization_ops(subset_cases: Any) -> None:
    cases = subset_cases  # the selection alone: the sweep itself runs once, for the next test
    names = {c.name for c in cases}
    for wanted in ["nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.InstanceNorm1d",
                   "nn.functional.batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                   "extra:torch.batch_norm.train", "extra:torch.batch_norm.eval",
                   "extra:aten.batch_norm_update_stats", "nn.LSTM"]:
        assert wanted in names, wanted
    assert sum(c.source == "op_db" for c in cases) >= 20  # a real sample of the rest


def test_subset_finds_no_undeclared_write_missing_from_the_table(subset: Any) -> None:
    _, result = subset
    assert not result.missing, sweep.format_result(result)
    found = {(f.op, f.arg) for f in result.findings.values()}
    # The sweep sees what it must see, so "nothing missing" means something.
    assert {("aten::native_batch_norm", "running_mean"), ("aten::native_batch_norm", "running_var"),
            ("aten::native_batch_norm.out", "running_mean"), ("aten::batch_norm_update_stats", "running_var"),
            ("aten::mkldnn_rnn_layer_backward", "workspace")} <= found, sweep.format_result(result)
    bn = result.findings[("aten::native_batch_norm", "running_mean", "values")]
    assert "only when training=True" in sweep._condition(bn)  # eval mode calls it too, and does not write
    # A bound on the sweep's growth, not a benchmark: it took 35 CPU-s in CI's slow tier on the 2-core box
    # with both workers busy (about 20 on an idle one).
    assert result.cpu_seconds < 60, f"the pinned subset took {result.cpu_seconds:.0f} CPU seconds"


def test_sweep_fails_on_a_write_missing_from_the_table(table: dict[str, Any],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    del table["aten::native_batch_norm"]
    threads = torch.get_num_threads()
    try:
        status = sweep.main(["--ops", "nn.BatchNorm1d", "--sources", "module_db", "--threads", str(threads)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert status == 1, out
    assert "aten::native_batch_norm  running_mean values" in out and "MISSING from table" in out
    assert "FAIL: aten::native_batch_norm running_mean, aten::native_batch_norm running_var missing" in out


@pytest.mark.every_engine
def test_eval_calls_do_not_count_as_writes(table: dict[str, Any], engine: str) -> None:
    """A table entry without its `training` condition would flag every eval-mode call."""
    if engine in ("compiled", "kernels"):
        pytest.skip("a write hook reads the table once, when it is installed")
    table["aten::native_batch_norm"] = (("running_mean", "running_var"), None)
    result = sweep.run_sweep(sweep.select_cases(["nn.BatchNorm1d"], sources=["module_db"]))
    assert not result.missing  # over-declaring never fails the sweep...
    bn = torch.nn.BatchNorm1d(3).eval()
    with kvguard.guard({"rm": bn.running_mean}, action="record") as g:
        bn(torch.randn(4, 3))
    assert [e.op for e in g.report.events] == ["aten.native_batch_norm.default"]  # ...but it is wrong


_lib = torch.library.Library("kvguard_sweep_test", "DEF")
_lib.define("sneaky(Tensor x, Tensor buf) -> Tensor")
_lib.impl("sneaky", lambda x, buf: x + buf.add_(1), "CPU")


def test_sweep_finds_an_op_that_hides_its_write(table: dict[str, Any]) -> None:
    def build() -> Any:
        x, buf = torch.zeros(3), torch.zeros(3)
        return lambda: torch.ops.kvguard_sweep_test.sneaky(x, buf)

    case = sweep.callable_case("custom:sneaky", build)
    result = sweep.run_sweep([case])
    assert [(f.op, f.arg, f.calls, f.covered_calls) for f in result.missing] == [
        ("kvguard_sweep_test::sneaky", "buf", 1, 0)]

    table["kvguard_sweep_test::sneaky"] = (("buf",), None)
    kv_torch._facts_cache.clear()
    result = sweep.run_sweep([case])
    assert not result.missing and len(result.findings) == 1


def test_sweep_rules_out_views_of_a_written_argument() -> None:
    def build() -> Any:
        x, y = torch.arange(3.0), torch.ones(3)
        return lambda: (x.add_(x), torch.mul(y, 2, out=y))  # `other`, `self`: the written tensor

    result = sweep.run_sweep([sweep.callable_case("custom:alias", build)])
    assert not result.findings
    assert [(r.op, r.arg, r.reason) for r in result.ruled_out.values()] == [
        ("aten::add_.Tensor", "other", "a view of an argument the schema marks written"),
        ("aten::mul.out", "self", "a view of an argument the schema marks written")]


def test_sweep_compares_bytes_so_nan_is_no_change_and_sign_of_zero_is() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert sweep._changed(nan.clone(), sweep._meta(nan), nan) is None
    zero = torch.tensor([0.0])
    before = zero.clone()
    zero.neg_()
    assert sweep._changed(before, sweep._meta(zero), zero) == "values"


def test_every_table_row_matches_its_schema() -> None:
    """Parameter names and conditions exist, are Tensors / bools, and are really undeclared."""
    assert "aten::native_batch_norm" in kv_torch._UNDECLARED_WRITES
    for key, (names, when) in kv_torch._UNDECLARED_WRITES.items():
        qualified, _, overload = key.partition(".")
        namespace, _, name = qualified.partition("::")
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is None:  # not registered in this build
            continue
        func = getattr(packet, overload or "default")
        args = {a.name: a for a in func._schema.arguments}
        for n in names:
            assert n in args and "Tensor" in str(args[n].type), (key, n)
            assert args[n].alias_info is None or not args[n].alias_info.is_write, f"{key} now declares {n}"
        if when is not None:
            assert str(args[when].type) == "bool", (key, when)
        facts = kv_torch._learn(func)
        learned = {w.name: w for w in facts.written}
        assert set(names) <= set(learned), key
        assert all((learned[n].when is not None) == (when is not None) for n in names), key
        assert facts.kind == "write" and not facts.self_only


def test_written_tensors_follow_the_training_flag() -> None:
    facts = kv_torch.op_facts(torch.ops.aten.native_batch_norm.default)
    x, rm, rv = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
    assert kv_torch.written_tensors(facts, (x, None, None, rm, rv, True, 0.1, 1e-5), {}) == [rm, rv]
    assert kv_torch.written_tensors(facts, (x, None, None, rm, rv, False, 0.1, 1e-5), {}) == []
    assert kv_torch.written_tensors(facts, (x, None, None, rm, rv), {"training": True}) == [rm, rv]
    out = kv_torch.op_facts(torch.ops.aten.native_batch_norm.out)
    o, sm, si = torch.empty(4, 3), torch.empty(3), torch.empty(3)
    kw = {"out": o, "save_mean": sm, "save_invstd": si}
    assert kv_torch.written_tensors(out, (x, None, None, rm, rv, False, 0.1, 1e-5), kw) == [o, sm, si]
    assert kv_torch.written_tensors(out, (x, None, None, rm, rv, True, 0.1, 1e-5), kw) == [rm, rv, o, sm, si]


# ---------------------------------------------------------------------------------------
# The guard, end to end


def test_record_names_the_op_and_the_line_of_bn() -> None:
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    before = bn.running_mean.clone()
    with kvguard.guard({"rm": bn.running_mean, "rv": bn.running_var}, name="stats", action="record") as g:
        bn(x)  # MARK: bn-record
    events = g.report.events
    assert not g.report.ok
    assert [(e.path, e.op, e.kind, e.blocked, os.path.basename(e.filename), e.lineno) for e in events] == [
        (path, "aten.native_batch_norm.default", "write", False, THIS_FILE, _line("bn-record"))
        for path in ("stats['rm']", "stats['rv']")]
    assert events[0].code == "bn(x)  # MARK: bn-record"
    assert not torch.equal(bn.running_mean, before)  # record lets the update happen
    assert "3/3 elements changed" in events[0].diff
    assert g.report.format().splitlines()[0] == (
        f"stats['rm'] was modified in place by aten.native_batch_norm.default at {THIS_FILE}:{_line('bn-record')}")


def test_raise_blocks_the_update_and_keeps_the_statistics() -> None:
    bn = torch.nn.BatchNorm2d(4)
    x = torch.randn(2, 4, 3, 3)
    mean, var = bn.running_mean.clone(), bn.running_var.clone()
    versions = bn.running_mean._version, bn.running_var._version
    with pytest.raises(kvguard.MutationError, match=r"aten\.native_batch_norm") as info:
        with kvguard.guard({"bn": {"running_mean": bn.running_mean, "running_var": bn.running_var}},
                           name="state", action="raise"):
            bn(x)  # MARK: bn-raise
    ev = info.value.event
    assert (ev.path, ev.blocked, ev.lineno) == ("state['bn']['running_mean']", True, _line("bn-raise"))
    assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)
    assert (bn.running_mean._version, bn.running_var._version) == versions


def test_eval_mode_reads_the_statistics_and_is_no_event() -> None:
    bn = torch.nn.BatchNorm1d(3).eval()
    with kvguard.guard({"rm": bn.running_mean, "rv": bn.running_var}, action="raise") as g:
        y = bn(torch.randn(8, 3))
        torch.nn.functional.batch_norm(torch.randn(8, 3), bn.running_mean, bn.running_var, training=False)
    assert g.report.ok and not g.report.events and y.shape == (8, 3)


def test_training_without_tracked_statistics_writes_nothing_protected() -> None:
    bn = torch.nn.BatchNorm1d(3, track_running_stats=False)
    with kvguard.guard({"w": bn.weight, "b": bn.bias}, action="raise") as g:
        bn(torch.randn(8, 3))
    assert g.report.ok


@pytest.mark.every_engine
@pytest.mark.parametrize("call", [
    pytest.param(lambda x, rm, rv: torch.nn.functional.batch_norm(x, rm, rv, training=True), id="F.batch_norm"),
    pytest.param(lambda x, rm, rv: torch.batch_norm(x, None, None, rm, rv, True, 0.1, 1e-5, False),
                 id="torch.batch_norm"),
    pytest.param(lambda x, rm, rv: torch.native_batch_norm(x, None, None, rm, rv, True, 0.1, 1e-5),
                 id="torch.native_batch_norm"),
    pytest.param(lambda x, rm, rv: torch.ops.aten.native_batch_norm.default(
        x, None, None, rm, rv, training=True, momentum=0.1, eps=1e-5), id="training-as-keyword"),
    pytest.param(lambda x, rm, rv: torch._native_batch_norm_legit(x, None, None, rm, rv, True, 0.1, 1e-5),
                 id="torch._native_batch_norm_legit"),
    pytest.param(lambda x, rm, rv: torch.batch_norm_update_stats(x, rm, rv, 0.1), id="batch_norm_update_stats"),
    pytest.param(lambda x, rm, rv: torch.nn.functional.instance_norm(
        x.view(2, 4, 3), rm, rv, use_input_stats=True), id="F.instance_norm"),
])
def test_every_entry_point_is_caught_and_blocked(call: Any, engine: str) -> None:
    x = torch.randn(6, 4)
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    before = rm.clone(), rv.clone()
    if engine in ("compiled", "kernels") and "batch_norm_update_stats" in call.__code__.co_names:
        # Its autograd kernel skips ADInplaceOrView: the write hook never sees it, the exit check does.
        with kvguard.guard({"rm": rm, "rv": rv}, name="s", action="record") as g:
            call(x, rm, rv)
        assert {(e.path, e.kind) for e in g.report.events} == {("s['rm']", "unobserved"), ("s['rv']", "unobserved")}
        return
    with pytest.raises(kvguard.MutationError):
        with kvguard.guard({"rm": rm, "rv": rv}, name="s", action="raise"):
            call(x, rm, rv)
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])
    with kvguard.guard({"rm": rm, "rv": rv}, name="s", action="record") as g:
        call(x, rm, rv)
    assert {e.path for e in g.report.events} == {"s['rm']", "s['rv']"}
    assert all(os.path.basename(e.filename) == THIS_FILE for e in g.report.events)


def test_instance_norm_module_with_tracked_statistics() -> None:
    m = torch.nn.InstanceNorm1d(3, track_running_stats=True)
    mean = m.running_mean.clone()
    with pytest.raises(kvguard.MutationError):
        with kvguard.guard({"rm": m.running_mean}, action="raise"):
            m(torch.randn(2, 3, 5))
    assert torch.equal(m.running_mean, mean)
