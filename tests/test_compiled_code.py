"""Code compiled by `torch.compile`: writes inside inductor's graphs at their line, and kvguard
invisible to the compiler.

Inductor writes the inputs a graph mutates inside its own kernels, where no op is dispatched:
the graph's call is judged first, from the inputs its artifact says it mutates, so under
"raise" the data is intact and the report names the write's line in the user's function.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import kvguard

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's imports, not kvguard


def _shape_kl(d: dict[str, Any], coef: float) -> torch.Tensor:
    k = d["kl"]
    k *= coef  # THE WRITE
    return k.sum()


def _bump_first(d: dict[str, Any]) -> torch.Tensor:
    row = d["kl"][0]
    row += 1.0  # FIRST ROW
    return d["kl"].mean()


def _ema(p: torch.Tensor, other: torch.Tensor) -> None:
    p.mul_(0.5).add_(other, alpha=0.5)  # EMA WRITE


def _scale(t: torch.Tensor) -> None:
    t.mul_(3.0)  # SAVED WRITE


def _line_of(fn: Callable[..., Any], marker: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if marker in line)


@pytest.mark.parametrize("write, marker, options", [
    (_shape_kl, "THE WRITE", {}),
    (_bump_first, "FIRST ROW", {}),
    (_shape_kl, "THE WRITE", {"backend": "aot_eager"}),  # the mutation applied by an op: the hook's
    pytest.param(_shape_kl, "THE WRITE", {"mode": "reduce-overhead"}, marks=pytest.mark.slow),
])
def test_an_inductor_graph_writing_a_guarded_dict_is_stopped_at_the_line_data_intact(
        write: Any, marker: str, options: dict[str, Any]) -> None:
    torch._dynamo.reset()
    d = {"kl": torch.arange(8.0).reshape(2, 4)}
    before = d["kl"].clone()
    compiled = torch.compile(write, **options)
    args = (d, 2.0) if write is _shape_kl else (d,)
    with pytest.raises(kvguard.MutationError) as caught:
        with kvguard.guard(d, name="rollout_data", action="raise"):
            compiled(*args)
    event = caught.value.event
    assert (event.path, event.op, event.blocked) == ("rollout_data['kl']", "aten.copy_.default", True)
    assert (os.path.basename(event.filename), event.lineno) == ("test_compiled_code.py", _line_of(write, marker))
    assert torch.equal(d["kl"], before), "stopped before the compiled kernels ran"


def _module_from(path: Any, text: str) -> Any:
    import importlib.util

    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_JOB = """
import torch

def shape(d):
    k = d["kl"]
    k *= 3.25{comment}
    return k.sum()
"""


def test_a_cached_graph_from_another_file_is_reported_at_this_files_line(tmp_path: Any) -> None:
    """An FX graph cache hit carries the comments of the first compile of an equal graph: here
    another file, whose line numbers differ. The write is found in the running function."""
    torch._dynamo.reset()
    first = _module_from(tmp_path / "first_job.py", _JOB.format(comment=""))
    torch.compile(first.shape)({"kl": torch.ones(5)})  # compiled and cached, with first_job.py's lines
    torch._dynamo.reset()
    second = _module_from(tmp_path / "second_job.py", "\n\n\n" + _JOB.format(comment="  # moved, commented"))
    d = {"kl": torch.ones(5)}
    with pytest.raises(kvguard.MutationError) as caught:
        with kvguard.guard(d, action="raise"):
            torch.compile(second.shape)(d)
    event = caught.value.event
    assert (os.path.basename(event.filename), event.lineno, event.code) == (
        "second_job.py", 9, "k *= 3.25  # moved, commented")
    assert torch.equal(d["kl"], torch.ones(5))


def test_under_warn_the_compiled_write_is_reported_once_with_its_values() -> None:
    torch._dynamo.reset()
    d = {"kl": torch.arange(4.0)}
    compiled = torch.compile(_shape_kl)
    with kvguard.guard(d, name="rollout_data", action="record") as g:
        out = compiled(d, 2.0)
        compiled(d, 2.0)  # the cached graph: judged at every call
    assert float(out) == 12.0 and torch.equal(d["kl"], torch.arange(4.0) * 4), "the job ran as without kvguard"
    events = g.report.events
    assert [(e.kind, e.lineno, e.blocked) for e in events] == [("write", _line_of(_shape_kl, "THE WRITE"), False)] * 2
    assert events[0].before.startswith("[0, 1, 2, 3]") and events[0].after.startswith("[0, 2, 4, 6]")


def test_a_compiled_write_to_unguarded_memory_is_silent_and_a_clone_is_not_the_entry() -> None:
    torch._dynamo.reset()
    d = {"kl": torch.arange(4.0)}
    compiled = torch.compile(_shape_kl)
    with kvguard.guard(d, action="raise") as g:
        compiled({"kl": d["kl"].clone()}, 2.0)
        compiled({"kl": torch.ones(4)}, 3.0)
    assert g.report.events == [] and torch.equal(d["kl"], torch.arange(4.0))


def test_a_compiled_write_to_a_watched_weight_outside_the_step_is_stopped() -> None:
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model.weight.detach().clone()
    ema = torch.compile(_ema)
    with pytest.raises(kvguard.MutationError) as caught:
        with kvguard.guard_module(model, optimizer=opt, action="raise"):
            with torch.no_grad():
                ema(model.weight, torch.zeros(4, 4))
    event = caught.value.event
    assert (event.path, event.lineno) == ("model.weight", _line_of(_ema, "EMA WRITE"))
    assert torch.equal(model.weight.detach(), weight)


def test_a_compiled_write_to_a_tensor_a_compiled_forward_saved_is_stopped() -> None:
    torch._dynamo.reset()
    w = torch.randn(4, requires_grad=True)
    h = torch.ones(4)
    forward = torch.compile(lambda w, h: (w * h).sum())
    scale = torch.compile(_scale)
    with pytest.raises(kvguard.MutationError) as caught:
        with kvguard.guard_autograd(action="raise"):
            loss = forward(w, h)  # saves h for backward
            scale(h)
    assert caught.value.event.lineno == _line_of(_scale, "SAVED WRITE")
    assert torch.equal(h, torch.ones(4)), "what backward reads is intact"
    assert loss.grad_fn is not None


class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.rows = [torch.arange(4.0) + i for i in range(3)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.rows[i]}  # the dataset's own tensor, not a copy


def _normalise(sample: dict[str, torch.Tensor]) -> torch.Tensor:
    x = sample["x"]
    x -= x.mean()  # DATA WRITE
    return x


def test_a_compiled_write_to_what_a_dataset_returned_is_reported_at_the_line() -> None:
    torch._dynamo.reset()
    rows = _Rows()
    with kvguard.guard_data(action="record") as g:
        _normalise_compiled = torch.compile(_normalise)
        _normalise_compiled(rows[1])
    assert [(e.path, e.kind, e.lineno) for e in g.report.events] == [
        ("_Rows[1]['x']", "write", _line_of(_normalise, "DATA WRITE"))]
    assert g.report.events[0].before.startswith("[1, 2, 3, 4]")


def _train(guarded: bool) -> tuple[list[float], dict[str, int], list[str]]:
    """A compiled model, loss and optimizer step, 3 steps: losses, Dynamo's counters, warnings."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.LayerNorm(4))  # a weight, a bias, a norm
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cmodel = torch.compile(model)
    loss_fn = torch.compile(lambda out, y: torch.nn.functional.cross_entropy(out, y))
    step = torch.compile(lambda: opt.step())
    rollout = {"x": torch.randn(3, 8, 16), "y": torch.randint(0, 4, (3, 8))}
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (kvguard.guard_module(model, optimizer=opt, action="raise") if guarded else _nothing()), \
                (kvguard.guard_autograd(action="raise") if guarded else _nothing()), \
                (kvguard.guard(rollout, action="raise") if guarded else _nothing()):
            for i in range(3):
                loss = loss_fn(cmodel(rollout["x"][i]), rollout["y"][i])
                loss.backward()
                step()
                opt.zero_grad()
                losses.append(loss.item())
    seen = {"frames": counters["frames"]["total"], "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"]["unique_graphs"], "calls_captured": counters["stats"]["calls_captured"]}
    return losses, seen, sorted({str(w.message)[:80] for w in caught if w.category is not DeprecationWarning})


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def test_a_clean_compiled_job_is_silent_bitwise_equal_and_compiles_the_same_graphs() -> None:
    plain_losses, plain, plain_warnings = _train(guarded=False)
    losses, seen, new_warnings = _train(guarded=True)
    assert losses == plain_losses, "bitwise-equal losses"
    assert seen == plain, "the same frames, graph breaks and graphs as without kvguard"
    assert new_warnings == plain_warnings


@pytest.mark.slow
def test_env_targets_leave_a_compiled_training_loop_as_it_compiles_without_kvguard(tmp_path: Any) -> None:
    """The loop of benchmarks/bench_compiled.py, in fresh processes, without and with env targets."""
    bench = _module_from(tmp_path / "bench_compiled.py",
                         (Path(__file__).parent.parent / "benchmarks" / "bench_compiled.py").read_text())
    plain = bench.compiled_loop({})
    guarded = bench.compiled_loop({"KVGUARD": "raise", "KVGUARD_TARGETS": "autograd,weights,data"})
    stderr = guarded["stderr"]
    for run in (plain, guarded):
        del run["stderr"], run["cpu_s"]
    assert guarded == plain  # losses, frames, graph breaks, graphs and warnings
    assert "weights: 6 parameters and buffers watched over 3 optimizer steps, no in-place writes" in stderr
    assert "Dynamo does not know how to trace" not in stderr
