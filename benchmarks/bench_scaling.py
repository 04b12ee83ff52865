"""What a writing op, a placement, a write, a guard's entry and its bookkeeping cost as the number
of protected tensors grows.

The protected object is a rollout of N tensors of 16 floats in 6 per-sample lists (made
before anything is measured). Under `kvguard.guard(rollout)` with the `compiled` engine
(``action="raise"``; ``"record"`` where writes to protected tensors are measured):

* ``write``: a loop of in-place ops on a temporary (``t.add_(1)``): none writes protected
  memory, so each pays the placement check (the watched containers compared in C++) and
  the storage-range lookup. The figure is the extra CPU time per op over the same loop
  with the hook installed and no guard (so the boxed call itself is not counted);
* ``placement``: an append loop (``rollout["new"].append(t)`` followed by a write op,
  which makes the guard look): the CPU time per placement, including the write op;
* ``first write``: the first write to a protected tensor after the guard is entered
  (``action="record"``, reported): the wall time of that one op, when the lookup index
  over every protected tensor is built (issue 17's cliff);
* ``later write``: five further writes to other protected tensors under the same guard,
  each reported: the median wall time, what every write after the first costs;
* ``entry + exit``: entering and leaving ``action="raise"`` around an empty body, CPU
  time per protected tensor;
* ``bookkeeping``: what the guard holds while entered, after its first write (so that an
  index built lazily is counted wherever it is built), per protected tensor: the Python
  heap it adds (``tracemalloc``; the tensors were made before tracing, so are not
  counted) and the growth of the process's resident memory (``/proc/self/statm``),
  which also sees the C++ heap that ``tracemalloc`` misses. Resident memory moves in
  pages and freed heap may be reused, so read that column at 15,000 tensors and up.

Each figure is the median of ``--rounds`` runs; the guard is entered before the clock
starts. Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_scaling.py
    PYTHONPATH=. python benchmarks/bench_scaling.py --sizes 49,1500 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import time
import tracemalloc
from typing import Any, Callable

import torch

import kvguard
from kvguard._engine import choice as _choice

WRITES = 20_000
PLACEMENTS = 1_000
LATER_WRITES = 5


def _rollout(n: int) -> dict[str, Any]:
    """n tensors of 16 floats in 6 per-sample lists."""
    return {f"k{i}": [torch.ones(16) for _ in range(n // 6 + (i < n % 6))] for i in range(6)}


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


def _count(rollout: dict[str, Any]) -> int:
    return sum(len(v) for v in rollout.values())


def _targets(rollout: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors written under one guard: the first, then LATER_WRITES others, in other lists."""
    lists = [rollout[f"k{i}"] for i in (3, 0, 5, 1, 4, 2)]
    return [lst[len(lst) * (7 + 2 * i) // 19] for i, lst in enumerate(lists[:LATER_WRITES + 1])]


def writes(rollout: dict[str, Any], rounds: int) -> tuple[float, float]:
    """(ms for the first write to a protected tensor under a new guard, median ms of the writes after it)."""
    targets = _targets(rollout)
    first: list[float] = []
    later: list[float] = []
    for _ in range(rounds):
        with kvguard.guard(rollout, name="rollout", action="record") as g:
            gc.collect()
            for i, target in enumerate(targets):
                start = time.perf_counter()
                target.add_(1.0)
                (later if i else first).append(time.perf_counter() - start)
        assert len(g.report.events) == len(targets), g.report.events
    return statistics.median(first) * 1e3, statistics.median(later) * 1e3


def entry_exit(rollout: dict[str, Any], rounds: int) -> float:
    """CPU µs per protected tensor to enter and leave a guard around an empty body."""
    def once() -> None:
        with kvguard.guard(rollout, name="rollout", action="raise"):
            pass
    return _cpu(once, rounds) / _count(rollout) * 1e6


def _resident() -> int:
    """This process's resident bytes (/proc/self/statm counts pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Collect, then hand freed heap back to the system, so that the guard's growth is not
    hidden by memory freed earlier and reused."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _held(rollout: dict[str, Any], target: torch.Tensor, read: Callable[[], int]) -> int:
    """How much `read()` grows from before a guard over `rollout` to inside it, after its first write."""
    before = read()
    with kvguard.guard(rollout, name="rollout", action="record"):
        target.add_(1.0)  # the first write: what is built for it is bookkeeping too
        gc.collect()
        return read() - before


def bookkeeping(rollout: dict[str, Any]) -> tuple[float, float]:
    """(Python heap bytes, resident bytes) per protected tensor that an entered guard holds."""
    target = _targets(rollout)[0]
    _trim()
    resident = _held(rollout, target, _resident)
    tracemalloc.start()  # after the tensors were made: they are not counted
    try:
        gc.collect()
        heap = _held(rollout, target, lambda: tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    n = _count(rollout)
    return heap / n, resident / n


COLUMNS = ("protected tensors", "extra ns per writing op", "µs per placement", "ms for the first write",
           "ms for a later write", "entry + exit µs per tensor", "Python heap bytes per tensor",
           "resident bytes per tensor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="49,1500,15000,100000", help="protected tensor counts")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _choice.install_only("compiled")
    warm = _rollout(6)
    with kvguard.guard(warm, name="warm", action="record"):  # the process's first guard imports and caches
        warm["k0"][0].add_(1.0)
    print(" | ".join(COLUMNS))
    print("|".join("---" for _ in COLUMNS))
    for n in (int(s) for s in args.sizes.split(",")):
        rollout = _rollout(n)  # before any reading: the bookkeeping columns leave the tensors out
        heap, resident = bookkeeping(rollout)
        per_write, per_placement = measure(n, args.rounds)
        first, later = writes(rollout, args.rounds)
        per_tensor = entry_exit(rollout, args.rounds)
        print(f"{_count(rollout):,} | {per_write:,.0f} | {per_placement:,.1f} | {first:,.2f} | {later:,.3f} | "
              f"{per_tensor:,.2f} | {heap:,.0f} | {resident:,.0f}", flush=True)
        del rollout


if __name__ == "__main__":
    main()
