"""What a writing op and a placement cost as the number of protected tensors grows.

The protected object is a rollout of N tensors of 16 floats in 6 per-sample lists. Under
`kvguard.guard(rollout, action="raise")` with the `compiled` engine:

* ``write``: a loop of in-place ops on a temporary (``t.add_(1)``): none writes protected
  memory, so each pays the placement check (the watched containers compared in C++) and
  the storage-range lookup. The figure is the extra CPU time per op over the same loop
  with the hook installed and no guard (so the boxed call itself is not counted);
* ``placement``: an append loop (``rollout["new"].append(t)`` followed by a write op,
  which makes the guard look): the CPU time per placement, including the write op;
* ``first write``: the first write to a protected tensor after the guard is entered
  (``action="record"``, reported): the wall time of that one op, when the lookup index
  over every protected tensor is built.

Each figure is the median of ``--rounds`` runs; the guard is entered before the clock
starts. Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_scaling.py
    PYTHONPATH=. python benchmarks/bench_scaling.py --sizes 49,1500 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Callable

import torch

import kvguard
from kvguard._engine import choice as _choice

WRITES = 20_000
PLACEMENTS = 1_000


def _rollout(n: int) -> dict[str, Any]:
    return {f"k{i}": [torch.ones(16) for _ in range(n // 6)] for i in range(6)}


def _cpu(fn: Callable[[], Any], rounds: int) -> float:
    """Median CPU seconds of `fn` over `rounds` runs (the collector run before each, off during)."""
    times = []
    for _ in range(rounds):
        gc.collect()
        gc.disable()
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
        gc.enable()
    return statistics.median(times)


def _writes(t: torch.Tensor) -> None:
    for _ in range(WRITES):
        t.add_(1.0)


def measure(n: int, rounds: int) -> tuple[float, float]:
    """(extra ns per writing op, µs per placement) with `n` protected tensors."""
    rollout = _rollout(n)
    t = torch.zeros(16)
    idle = _cpu(lambda: _writes(t), rounds)
    with kvguard.guard(rollout, name="rollout", action="raise") as g:
        assert g.engine == "compiled", g.engine
        guarded = _cpu(lambda: _writes(t), rounds)
    per_write = (guarded - idle) / WRITES * 1e9

    def place() -> float:
        rollout["new"] = []
        with kvguard.guard(rollout, name="rollout", action="raise"):
            gc.collect()
            gc.disable()
            start = time.process_time()
            for _ in range(PLACEMENTS):
                rollout["new"].append(torch.ones(16))
                t.add_(1.0)  # the look happens before this write
            took = time.process_time() - start
            gc.enable()
        return took
    place_time = statistics.median(place() for _ in range(rounds)) - idle * PLACEMENTS / WRITES
    return per_write, place_time / PLACEMENTS * 1e6


def first_write(n: int, rounds: int) -> float:
    """Milliseconds for the first write to a protected tensor under a new guard over `n` tensors."""
    rollout = _rollout(n)
    target = rollout["k3"][len(rollout["k3"]) * 7 // 9]
    times = []
    for _ in range(rounds):
        with kvguard.guard(rollout, name="rollout", action="record") as g:
            gc.collect()
            start = time.perf_counter()
            target.add_(1.0)
            times.append(time.perf_counter() - start)
        assert len(g.report.events) == 1, g.report.events
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="49,1500,15000,100000", help="protected tensor counts")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _choice.install_only("compiled")
    print("protected tensors | extra ns per writing op | µs per placement | ms for the first write")
    print("---|---|---|---")
    for n in (int(s) for s in args.sizes.split(",")):
        per_write, per_placement = measure(n, args.rounds)
        print(f"{n:,} | {per_write:,.0f} | {per_placement:,.1f} | {first_write(n, args.rounds):,.1f}")


if __name__ == "__main__":
    main()
