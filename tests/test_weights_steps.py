"""An optimizer step under `guard_module`: its own writes never reach Python, and nothing else
is let through on their account.

The step's parameters are rows of a C++ table (`weights.StepSet`) that the compiled hook
admits while the step runs (`write_hook.admit`). These tests pin what that must not cost:
a write to a weight outside the step, a write inside the step to a parameter the optimizer
does not hold, a change made between steps with no op, a write another guard protects.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import kvguard
from kvguard._protect import weights as _weights

ROOT = Path(__file__).resolve().parent.parent
EACH = pytest.mark.parametrize("engine", ["compiled", "kernels", "mode"], indirect=True)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_forloop": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adamw_forloop": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=False),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
}


def _layers(n: int = 6) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(3, 3) for _ in range(n))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


@pytest.mark.parametrize("engine", ["compiled"], indirect=True)
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_steps_own_writes_never_enter_python(engine: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _layers()
    opt = OPTIMIZERS[kind](model.parameters())
    seen: list[int] = []
    original = _weights.ModuleSet.written_entries

    def counting(self: Any, written: Any, kind: str, resizes: bool = False) -> Any:
        seen.append(len(written))
        return original(self, written, kind, resizes)

    monkeypatch.setattr(_weights.ModuleSet, "written_entries", counting)
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        for _ in range(3):
            opt.step()
        assert seen == [], f"{kind}: {len(seen)} of the step's writes reached Python"
        with torch.no_grad(), pytest.raises(kvguard.MutationError):
            model[2].weight.mul_(2)  # outside the step: judged, and stopped, as before
    assert [e.path for e in g.report.events] == ["model.2.weight"]
    assert g.report.events[0].lineno > 0


@EACH
@pytest.mark.parametrize("kind", ["sgd_forloop", "adamw_foreach", "adamw_fused"])
def test_a_write_inside_step_to_a_parameter_the_optimizer_does_not_hold_is_reported(engine: str, kind: str) -> None:
    model = _layers()
    held = [p for i, p in enumerate(model.parameters()) if i != 5]
    opt = OPTIMIZERS[kind](held)
    inner = type(opt).step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = inner(self, *args, **kwargs)
        with torch.no_grad():
            model[2].bias.add_(1)  # not the optimizer's: a bug inside its step
        return out

    opt.step = step.__get__(opt)  # type: ignore[method-assign]
    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        opt.step()
        opt.step()
    assert [e.path for e in g.report.events] == ["model.2.bias", "model.2.bias"]
    assert all(e.op.startswith("aten.add_") for e in g.report.events)


@EACH
def test_a_numpy_write_between_steps_is_found_at_the_next_step_which_does_not_run(engine: str) -> None:
    model = _layers(40)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        opt.step()
        opt.step()
        np.asarray(model[17].weight.detach())[0, 0] += 1.0  # no dispatched op
        before = model[3].weight.detach().clone()
        with pytest.raises(kvguard.MutationError) as info:
            opt.step()
        assert torch.equal(model[3].weight.detach(), before)  # under raise the step did not run
        opt.step()  # found once: the next step runs
    assert info.value.event.path == "model.17.weight"
    assert [e.path for e in g.report.events] == ["model.17.weight"]


@EACH
def test_another_guard_still_sees_the_step_write_to_what_it_protects(engine: str) -> None:
    model = _layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    shared = {"w": model[1].weight}
    with kvguard.guard(shared, action="record", name="shared") as other:
        with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
            opt.step()
            opt.step()
    assert g.report.ok
    assert {e.path for e in other.report.events} == {"shared['w']"}


@EACH
def test_a_group_added_later_is_stepped_and_watched(engine: str) -> None:
    model = _layers()
    head = torch.nn.Linear(3, 3)
    head.weight.grad = torch.randn_like(head.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    whole = torch.nn.ModuleDict({"body": model, "head": head})
    with kvguard.guard_module(whole, optimizer=opt, action="record") as g:
        opt.step()
        opt.add_param_group({"params": [head.weight]})
        opt.step()
        opt.step()
        assert g.report.ok
        with torch.no_grad():
            head.weight.add_(1)  # between steps: reported at its line
    assert [e.path for e in g.report.events] == ["whole.head.weight"]


@pytest.mark.slow
def test_the_parameter_sweep_runs() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_param_sweep.py"), "--quick",
                          "--sizes", "40"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if "guard_module" in line]
    assert len(rows) == 6, out.stdout
