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
    print(f"guard_autograd / empty hooks: {statistics.median(times['guard_autograd']) / statistics.median(times['empty hooks']):.3f}")

    # Per saved tensor: one guard around a loop of ops that each save one tensor (`sigmoid`
    # saves its result); the collector off for every contender, so none pays for another's garbage.
    x = torch.randn(16, requires_grad=True)
    n = 1000 if args.quick else 5000

    def saving_loop(name: str) -> float:
        keep = []
        gc.collect()
        gc.disable()
        try:
            with contexts[name]():
                start = time.process_time()
                for _ in range(n):
                    keep.append(torch.sigmoid(x))
                return (time.process_time() - start) / n
        finally:
            gc.enable()
    per: dict[str, list[float]] = {name: [] for name in contexts}
    for r in range(3 if args.quick else args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            per[name].append(saving_loop(name))
    med = {name: statistics.median(v) for name, v in per.items()}
    print(f"a loop of {n:,} ops that each save one tensor, one guard around it: us per op")
    for name in names:
        print(f"  {name:<16} {med[name] * 1e6:6.2f}")
    print(f"  guard_autograd beyond empty hooks: {(med['guard_autograd'] - med['empty hooks']) * 1e6:.2f} us per saved tensor")

    # A guard that is on (as KVGUARD_TARGETS=autograd leaves it) around forward passes that save
    # nothing (no_grad): what it costs them; then entering and leaving one.
    def nograd() -> float:
        with torch.no_grad():
            return _timed(lambda: state["model"](state["batch"][:, :-1]))
    nograd()
    plain, on = [], []
    with kvguard.guard_autograd():
        nograd()
        for _ in range(3 if args.quick else args.rounds):
            on.append(nograd())
    for _ in range(3 if args.quick else args.rounds):
        plain.append(nograd())
    print(f"forward under no_grad (nothing saved) inside an open guard_autograd / without: "
          f"{statistics.median(on) / statistics.median(plain):.3f}")
    start = time.process_time()
    for _ in range(200):
        with kvguard.guard_autograd():
            pass
    print(f"entering and leaving guard_autograd, nothing saved: {(time.process_time() - start) / 200 * 1e6:.0f} us")


if __name__ == "__main__":
    main()
