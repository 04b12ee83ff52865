"""Cost cliffs on the guarded write path: overlap of strided views, and big written tensors.

Each (case, mode) runs in a fresh interpreter, so that its peak memory is its own. The
child builds the tensors, warms kvguard up on a tiny dict, resets the kernel's peak-RSS
counter (``/proc/self/clear_refs``; ``ru_maxrss`` where that is not allowed), then times
one op and reports the peak resident memory above what it held just before the op.

Modes: ``unguarded`` (the op alone), ``guarded`` (the same op inside
``kvguard.guard(d, action="record")``, the guard entered before the clock starts), and for
the big-tensor cases ``clone`` (a plain ``x.clone()`` of the protected tensor: what one
pass over its data costs, the floor for taking a before-copy).

Cases:

* ``logits-miss``: ``logits[:, :-1, :]`` protected, ``logits[:, -1, :]`` written (a
  non-dense view whose byte span overlaps the write, no element shared), logits 2x2048x2048
  fp32 (``--llm``: also 4x4096x32000, 2 GB);
* ``logits-hit``: the same protected view, ``logits[:, 5, :]`` written (reported);
* ``big-all``: one 208 MB fp32 tensor (52M elements) protected, ``x.mul_(1.5)``;
* ``big-one``: the same tensor, ``x[40_000_000] = 7.0``;
* ``big-t``: a transposed 208 MB view protected (non-contiguous), ``p.mul_(1.5)``.

Run from the repository root::

    python benchmarks/bench_cliffs.py                 # every case, 3 runs each, median
    python benchmarks/bench_cliffs.py --repeat 1      # quicker
    python benchmarks/bench_cliffs.py --llm           # adds the 2 GB logits case
    python benchmarks/bench_cliffs.py --cases big-one # some cases only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = 52_000_000  # 208 MB of fp32


def _setup(case: str) -> tuple[dict[str, Any], Callable[[], Any], Any]:
    """(protected dict, the op, the tensor a `clone` run copies)."""
    import torch

    torch.manual_seed(0)
    if case.startswith("logits"):
        shape = (4, 4096, 32000) if case.endswith("-llm") else (2, 2048, 2048)
        logits = torch.empty(shape).normal_()
        row = 5 if "-hit" in case else -1
        return {"prefix": logits[:, :-1, :]}, lambda: logits[:, row, :].fill_(0.0), logits[:, :-1, :]
    if case == "big-t":
        base = torch.empty(6500, BIG // 6500).normal_()
        p = base.t()
        return {"x": p}, lambda: p.mul_(1.5), p
    x = torch.empty(BIG).normal_()
    if case == "big-all":
        return {"x": x}, lambda: x.mul_(1.5), x

    def one() -> None:
        x[40_000_000] = 7.0
    return {"x": x}, one, x


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(case: str, mode: str) -> dict[str, Any]:
    import gc

    import torch

    import kvguard

    torch.set_num_threads(1)
    protected, op, source = _setup(case)
    warm = {"w": torch.ones(8)}
    with kvguard.guard(warm, name="w", action="record"):
        warm["w"][2:5].mul_(2)  # imports and first-call costs, outside the measurement
    guard = kvguard.guard(protected, name="d", action="record") if mode == "guarded" else None
    if guard is not None:
        guard.__enter__()
    gc.collect()
    exact = _reset_peak()
    before = _rss()
    start = time.perf_counter()
    kept = source.clone() if mode == "clone" else op()
    seconds = time.perf_counter() - start
    peak = _peak() if exact else __import__("resource").getrusage(0).ru_maxrss * 1024
    del kept
    diff = None
    if guard is not None:
        guard.__exit__(None, None, None)
        events = guard.report.events
        diff = events[0].diff if events else "(no event)"
    return {"seconds": seconds, "extra": max(0, peak - before), "diff": diff, "exact_peak": exact}


def run_child(case: str, mode: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, __file__, "--child", case, mode], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{case}/{mode} failed:\n{proc.stderr}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _mb(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="fresh-process runs per (case, mode); median")
    parser.add_argument("--llm", action="store_true", help="add logits-miss-llm (4x4096x32000 fp32, 2 GB)")
    parser.add_argument("--cases", nargs="*", help="run only these cases")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    cases = ["logits-miss", "logits-hit", "big-all", "big-one", "big-t"] + (["logits-miss-llm"] if args.llm else [])
    if args.cases:
        cases = [c for c in cases if c in args.cases] + [c for c in args.cases if c not in cases]
    import torch

    print(f"torch {torch.__version__}, 1 thread, {args.repeat} fresh process(es) per cell, median; "
          f"extra = peak RSS during the op above RSS before it")
    print(f"{'case':<16} {'mode':<10} {'time ms':>10} {'extra MB':>9} {'× unguarded':>12} {'× clone':>8}")
    diffs = {}
    for case in cases:
        modes = ["unguarded", "guarded"] + (["clone"] if case.startswith("big") else [])
        rows = {}
        for mode in modes:
            runs = [run_child(case, mode) for _ in range(args.repeat)]
            rows[mode] = (statistics.median(r["seconds"] for r in runs), statistics.median(r["extra"] for r in runs))
            if mode == "guarded":
                diffs[case] = runs[0]["diff"]
        for mode in modes:
            seconds, extra = rows[mode]
            vs_unguarded = seconds / rows["unguarded"][0]
            vs_clone = f"{seconds / rows['clone'][0]:8.2f}" if "clone" in rows else f"{'':>8}"
            print(f"{case:<16} {mode:<10} {seconds * 1e3:10.2f} {_mb(extra):>9} {vs_unguarded:12.1f} {vs_clone}")
    print()
    for case, diff in diffs.items():
        print(f"{case}: {diff}")


if __name__ == "__main__":
    main()
