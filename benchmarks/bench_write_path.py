"""Where a writing op's cost goes under the compiled engine: the boxed call, the placement check.

The suite's `micro_inplace_100` row (20,000 in-place ops on 2048-element temporaries, none
protected) under four contenders, interleaved round by round, process CPU time:

* ``hook idle``: the compiled hook installed, no guard: every writing op pays the boxed
  call of kvguard's kernel on ADInplaceOrView (the floor unboxed kernels would lower);
* ``guard, no containers``: `kvguard.guard(t)` over one tensor: no container to watch, so
  no placement check; the op pays the storage-range lookup;
* ``guard, one watched value``: `kvguard.guard({"x": t})`: the placement check over one
  value, so what it costs beyond the comparison itself (taking the GIL, which torch's
  Python bindings release around the op, and calling the check);
* ``guard, the rollout``: `kvguard.guard(rollout_data)` over the suite's 385 tensors in
  per-sample lists (about 520 watched values).

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_write_path.py --rounds 9
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch

import kvguard
from kvguard._engine import choice as _choice

sys.path.insert(0, str(Path(__file__).parent))
import bench_suite  # noqa: E402 - the suite's rollout and loop

OPS = 20_000


def contenders(rollout: dict[str, Any]) -> dict[str, Callable[[], Optional[ContextManager[Any]]]]:
    bare = rollout["values"][0]
    return {
        "hook idle": lambda: None,
        "guard, no containers": lambda: kvguard.guard(bare, action="raise"),
        "guard, one watched value": lambda: kvguard.guard({"x": bare}, action="raise"),
        "guard, the rollout": lambda: kvguard.guard(rollout, action="raise"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _choice.install_only("compiled")
    rollout = bench_suite.make_rollout(64, 2048)
    found: dict[str, list[float]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, make in contenders(rollout).items():
            gc.collect()
            start = time.process_time()
            context = make()
            if context is None:
                bench_suite.micro_inplace_100(rollout, OPS)
            else:
                with context:
                    bench_suite.micro_inplace_100(rollout, OPS)
            found.setdefault(name, []).append(time.process_time() - start)
    idle = statistics.median(found["hook idle"][1:])
    print("contender | ms | / hook idle | ns per op beyond hook idle")
    print("---|---|---|---")
    for name, times in found.items():
        median = statistics.median(times[1:])
        print(f"{name} | {median * 1e3:.1f} | {median / idle:.3f} | {(median - idle) / OPS * 1e9:+.0f}")


if __name__ == "__main__":
    main()
