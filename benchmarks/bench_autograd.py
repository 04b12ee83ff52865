"""What `kvguard.guard_autograd()` costs: a transformer training step, and one saved tensor.

Alternates, round by round, the same step unguarded, under an empty `saved_tensors_hooks`
pair (the floor for any tool that sees saved tensors: a Python call per pack and unpack),
and under `guard_autograd(action="raise")` with the `compiled` engine; the guard is
entered and left around each step, as `KVGUARD_TARGETS=autograd` would not (it stays on),
so the figure includes entry and exit. CPU time, medians; the ratios are what to read.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_autograd.py            # ~1 min
    PYTHONPATH=. .venv/bin/python benchmarks/bench_autograd.py --quick    # smoke
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from contextlib import nullcontext
from typing import Any, Callable

import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import kvguard  # noqa: E402
from bench_suite import build_train, train_step  # noqa: E402

LM = {"vocab": 2048, "d": 128, "layers": 2, "heads": 4, "ff": 512, "seq": 128, "batch": 8, "logged": 64}
QUICK = {"vocab": 256, "d": 32, "layers": 1, "heads": 2, "ff": 64, "seq": 16, "batch": 2, "logged": 4}


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect(1)
    start = time.process_time()
    fn()
    return time.process_time() - start


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("KVGUARD_ENGINE", "compiled")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", kvguard.GuardWarning)  # the no_grad row saves nothing, on purpose
    state = build_train(QUICK if args.quick else LM, fused=False)
    contexts: dict[str, Callable[[], Any]] = {
        "unguarded": nullcontext,
        "empty hooks": lambda: torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
        "guard_autograd": lambda: kvguard.guard_autograd(action="raise"),
    }
    counts = {}

    def step(name: str) -> None:
        with contexts[name]() as g:
            train_step(state)
        if g is not None and hasattr(g, "protected_count"):
            counts[name] = g.protected_count
        state["protected"]["train/loss"].clear()
        state["protected"]["train/grad_norm"].clear()

    for name in contexts:  # warm-up: the engine's first load, torch's first dispatches
        step(name)
    times: dict[str, list[float]] = {name: [] for name in contexts}
    names = list(contexts)
    for r in range(2 if args.quick else args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            times[name].append(_timed(lambda: step(name)))
    base = statistics.median(times["unguarded"])
    saved = counts.get("guard_autograd", 0)
    print(f"training step: {LM if not args.quick else QUICK}, {saved} saved tensors per step, "
          f"{len(times['unguarded'])} rounds, CPU time")
    print("contender        median ms   / unguarded")
    for name in names:
        med = statistics.median(times[name])
        print(f"{name:<16} {med * 1e3:9.2f}   {med / base:9.3f}")
    extra = statistics.median(times["guard_autograd"]) - statistics.median(times["empty hooks"])
    print(f"guard_autograd beyond empty hooks: {extra * 1e6 / max(saved, 1):.2f} us per saved tensor")

    # A guard that is on but sees nothing saved: the same step under no_grad.
    def nograd(name: str) -> float:
        def run() -> None:
            with torch.no_grad(), contexts[name]():
                state["model"](state["batch"][:, :-1])
        return _timed(run)
    for name in ("unguarded", "guard_autograd"):
        nograd(name)
    pairs = [(nograd("unguarded"), nograd("guard_autograd")) for _ in range(3 if args.quick else args.rounds)]
    print(f"forward under no_grad (nothing saved): guard_autograd / unguarded "
          f"{statistics.median(b for _, b in pairs) / statistics.median(a for a, _ in pairs):.3f}")


if __name__ == "__main__":
    main()
