"""What a guarded optimizer step costs as the number of parameter tensors grows.

A `ModuleList` of tiny `Linear(8, 8)` layers (two parameter tensors each, 288 bytes), its
gradients set once, then `optimizer.step()` timed alone, for SGD (momentum 0.9) and AdamW
in their for-loop, foreach and fused forms, at 100 / 1,000 / 10,000 / 50,000 parameter
tensors. Contenders, interleaved round by round in one process (the order rotating):

- `plain`: no guard;
- `guard_module`: `kvguard.guard_module(model, optimizer=opt, action="raise")` open
  around the round's steps (entered and left outside the timing);
- `weights`: the process guard of `KVGUARD_TARGETS=weights` as its activation builds it
  (a `ModuleGuard` with no module, the optimizer added by `add_optimizer` with the
  modules `_holders` finds in this frame), entered around the round's steps.

A guarded run's first step, which makes the step's set of tensors (once per guard and
optimizer, linear in the tensors), is not timed: what is timed is every later step.

Each guarded round ends with a check that the guard reported nothing. CPU time
(`time.process_time`), the collector frozen during a run; per cell, the median of the
per-round ratios (guarded / plain of the same round) and the median time per step.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_param_sweep.py             # the table (~10 min)
    PYTHONPATH=. .venv/bin/python benchmarks/bench_param_sweep.py --quick     # smoke, seconds
    PYTHONPATH=. .venv/bin/python benchmarks/bench_param_sweep.py --sizes 1000,10000 --optimizers adamw
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

os.environ.setdefault("KVGUARD_ENGINE", "compiled")
import kvguard  # noqa: E402
from kvguard._activate import weights as _activation  # noqa: E402
from kvguard._guard.module import ModuleGuard  # noqa: E402

CONTENDERS = ("plain", "guard_module", "weights")
IMPLS = ("forloop", "foreach", "fused")


def build(tensors: int, optimizer: str, impl: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with `tensors` parameter tensors (Linear(8, 8) layers: weight and bias), grads set."""
    torch.manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(max(1, tensors // 2)))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    flags = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, **flags)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags)
    opt.step()  # the state made once, outside every timing
    return model, opt


def enter(contender: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    if contender == "plain":
        return None
    if contender == "guard_module":
        return kvguard.guard_module(model, optimizer=opt, action="raise", name="model").__enter__()
    guard = ModuleGuard([], (), name="weights", action="raise", target="weights")
    guard.__enter__()
    modules, loose = _activation._holders(opt, sys._getframe(1))
    guard.add_optimizer(opt, modules, loose)
    return guard


def timed(contender: str, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    """CPU seconds per step of `steps` steps under `contender`."""
    gc.collect()
    guard = enter(contender, model, opt)
    if guard is not None:
        opt.step()  # its first step under a guard makes the step's set (once per guard): not timed
    gc.freeze()
    gc.disable()
    try:
        start = time.process_time()
        for _ in range(steps):
            opt.step()
        elapsed = time.process_time() - start
    finally:
        gc.enable()
        gc.unfreeze()
        if guard is not None:
            guard.__exit__(None, None, None)
    if guard is not None:
        assert guard.report.ok, guard.report.format()
    return elapsed / steps


def cell(tensors: int, optimizer: str, impl: str, contenders: list[str], rounds: int, steps: int,
         say: Callable[[str], None]) -> dict[str, Any]:
    model, opt = build(tensors, optimizer, impl)
    for name in contenders:  # warm-up: imports, the hook's build and first install
        timed(name, model, opt, 1)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        k = r % len(contenders)
        for name in contenders[k:] + contenders[:k]:
            times[name].append(timed(name, model, opt, steps))
    base = times["plain"]
    result: dict[str, Any] = {"tensors": sum(1 for _ in model.parameters()), "optimizer": optimizer, "impl": impl,
                              "rounds": rounds, "steps": steps, "ms": {}, "ratio": {}}
    for name in contenders:
        result["ms"][name] = statistics.median(times[name]) * 1e3
        if name != "plain":
            result["ratio"][name] = statistics.median(t / b for t, b in zip(times[name], base))
    shown = "  ".join(f"{n} {result['ms'][n]:9.3f} ms" + (f" ({result['ratio'][n]:6.2f}x)" if n != "plain" else "")
                      for n in contenders)
    say(f"{optimizer:5} {impl:7} {result['tensors']:6d}  {shown}")
    return result


def steps_for(tensors: int, impl: str, budget: float) -> int:
    """Steps per timed run: about `budget` CPU seconds of plain steps (guessed per tensor)."""
    per_tensor = {"forloop": 25e-6, "foreach": 4e-6, "fused": 2e-6}[impl]
    return max(1, min(50, int(budget / (per_tensor * tensors))))


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000,50000", help="parameter tensors, comma-separated")
    parser.add_argument("--optimizers", default="sgd,adamw")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.05, help="CPU seconds of plain steps per timed run")
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 tensors (unless --sizes), 2 rounds "
                        "of one step: a smoke run")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    given = "--sizes" in (argv if argv is not None else sys.argv[1:])
    sizes = [100, 1000] if args.quick and not given else [int(s) for s in args.sizes.split(",")]
    rounds = 2 if args.quick else args.rounds
    contenders = ["plain"] + [c for c in args.contenders.split(",") if c != "plain"]
    print(f"torch {torch.__version__}, engine {os.environ['KVGUARD_ENGINE']}, {rounds} rounds; "
          "CPU ms per optimizer step (median), guarded / plain (median of per-round ratios)", flush=True)
    results = []
    for optimizer in args.optimizers.split(","):
        for impl in args.impls.split(","):
            for size in sizes:
                steps = 1 if args.quick else steps_for(size, impl, args.budget)
                results.append(cell(size, optimizer, impl, contenders, rounds, steps,
                                    lambda line: print(line, flush=True)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
