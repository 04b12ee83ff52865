"""What hearing a store costs: a tensor placed into a guarded dict, then a write op, per placement.

    PYTHONPATH=. python3.13 benchmarks/bench_stores.py [--rounds 5] [--n 3000]

Python 3.12+ only (dict watchers). Two contenders alternate in one process, round by round:
`heard` (the store is heard: its tensor digested as it is stored, its line noted) and
`unheard` (the watcher switched off, as on Python 3.11: the placement is read at the write
op). Each placement replaces the tensor under one key of a dict that also holds a list of
1,500 protected tensors (a rollout dict), then a write op on a scratch tensor makes the guard
look. Prints the median µs per placement of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvguard
from kvguard._protect import stores


def per_placement(n: int, heard: bool) -> float:
    available = stores.AVAILABLE
    stores.AVAILABLE = heard  # read by each guard as it starts
    try:
        rd = {"x": [torch.zeros(16) for _ in range(1500)], "kl": torch.zeros(16)}
        scratch = torch.zeros(1)
        placed = [torch.zeros(16) for _ in range(n)]
        with kvguard.guard(rd, name="rd", action="record"):
            start = time.perf_counter()
            for t in placed:
                rd["kl"] = t
                scratch.add_(1)
            took = time.perf_counter() - start
        return took / n * 1e6
    finally:
        stores.AVAILABLE = available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=3000)
    args = parser.parse_args()
    if not stores.AVAILABLE:
        raise SystemExit("this interpreter has no dict watchers (Python 3.12+), or the extension did not build")
    per_placement(200, True)  # warm: the hook built and installed, caches filled
    heard, unheard = [], []
    for _ in range(args.rounds):
        heard.append(per_placement(args.n, True))
        unheard.append(per_placement(args.n, False))
    h, u = statistics.median(heard), statistics.median(unheard)
    print(f"µs per placement (median of {args.rounds}): heard {h:.1f}, unheard {u:.1f}, ratio {h / u:.2f}")


if __name__ == "__main__":
    main()
