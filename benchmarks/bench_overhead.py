"""Overhead of `kvguard.guard` on ops that write nothing protected, side by side.

Three modes run the same workload in one process, interleaved round-robin:

* ``none``  - no dispatch mode at all (context: what plain eager PyTorch costs);
* ``empty`` - an empty ``TorchDispatchMode`` that only calls ``func`` (the floor for
  any Python dispatch mode: the trampoline itself);
* ``guard`` - ``kvguard.guard(rollout, action="raise")`` on the dispatch-mode engine
  (``KVGUARD_ENGINE=mode``): the floor for it is the empty mode. ``bench_suite.py``
  compares the engines with unguarded torch.

The budget is on ``guard / empty``: kvguard's own logic may add at most 15 % to what
an empty dispatch mode already costs. ``empty / none`` is printed for context only.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_overhead.py            # full run, ~1 min
    PYTHONPATH=. python benchmarks/bench_overhead.py --quick    # smaller workloads, seconds
    PYTHONPATH=. python benchmarks/bench_overhead.py --check    # exit 1 if over budget
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, ContextManager, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvguard

BUDGET = 1.15
MODES = ("none", "empty", "guard")
BATCH = 8
SEQ = 1024


class Empty(TorchDispatchMode):
    """The floor: a dispatch mode that does nothing but call the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class _Count(TorchDispatchMode):
    """Counts dispatched ops and the ones that write an argument (in-place / out=)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.writes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            self.writes += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------
# Data and workloads


def make_rollout(batch: int = BATCH, seq: int = SEQ) -> dict[str, Any]:
    """A rollout dict as RL trainers pass it around: 8 keys, mostly per-sample lists."""
    g = torch.Generator().manual_seed(0)

    def per_sample(make: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
        return [make() for _ in range(batch)]

    return {
        "tokens": per_sample(lambda: torch.randint(0, 32000, (seq,), generator=g)),
        "response_lengths": [seq] * batch,
        "rewards": per_sample(lambda: torch.randn(seq, generator=g)),
        "values": per_sample(lambda: torch.randn(seq, generator=g)),
        "log_probs": per_sample(lambda: torch.randn(seq, generator=g)),
        "ref_log_probs": per_sample(lambda: torch.randn(seq, generator=g)),
        "loss_masks": per_sample(lambda: (torch.rand(seq, generator=g) > 0.1).float()),
        "raw_reward": torch.randn(batch, generator=g),
    }


def micro(rollout: dict[str, Any], n_ops: int) -> torch.Tensor:
    """`n_ops` dispatched ops: mul, add, mul_ on a temporary, sub. Reads protected data only."""
    x = rollout["log_probs"][0]
    y = rollout["ref_log_probs"][1]
    t = x
    for _ in range(n_ops // 4):
        t = x * y       # aten.mul.Tensor
        t = t + y       # aten.add.Tensor
        t.mul_(0.5)     # aten.mul_.Tensor: writes, but only a temporary
        t = t - x       # aten.sub.Tensor
    return t


def reads(rollout: dict[str, Any], n_ops: int) -> torch.Tensor:
    """`n_ops` out-of-place ops on protected data: mul, add, mul, sub. Nothing is written."""
    x = rollout["log_probs"][0]
    y = rollout["ref_log_probs"][1]
    t = x
    for _ in range(n_ops // 4):
        t = x * y
        t = t + y
        t = t * 0.5
        t = t - x
    return t


def gae(rollout: dict[str, Any], gamma: float = 0.99, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GAE as RL trainers write it, then masked whitening. Writes only `adv`."""
    r = torch.stack(rollout["rewards"])
    v = torch.stack(rollout["values"])
    mask = torch.stack(rollout["loss_masks"])
    batch, seq = r.shape
    v = torch.cat([v, v.new_zeros(batch, 1)], dim=1)
    adv = torch.empty_like(r)
    lastgaelam = torch.zeros(batch)
    for t in reversed(range(seq)):
        delta = r[:, t] + gamma * v[:, t + 1] - v[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        adv[:, t] = lastgaelam  # select + copy_: an in-place write to an unprotected output
    returns = adv + v[:, :-1]
    n = mask.sum()
    mean = (adv * mask).sum() / n
    var = ((adv - mean) ** 2 * mask).sum() / n
    adv = (adv - mean) * torch.rsqrt(var + 1e-8) * mask
    return adv, returns


def workloads(quick: bool, samples: int = BATCH) -> dict[str, tuple[Callable[[dict[str, Any]], Any], dict[str, Any]]]:
    """name -> (function of the rollout dict, the rollout it runs on).

    `samples` is the length of the per-sample lists in the protected dict (the batch
    GAE runs over); the number of dispatched ops does not depend on it.
    """
    seq = 256 if quick else SEQ
    n_ops = 4_000 if quick else 20_000
    return {
        "reads": (lambda d: reads(d, n_ops), make_rollout(samples, SEQ)),
        "micro": (lambda d: micro(d, n_ops), make_rollout(samples, SEQ)),
        "gae": (gae, make_rollout(samples, seq)),
    }


# ---------------------------------------------------------------------------------------
# Measurement


def _context(mode: str, rollout: dict[str, Any]) -> ContextManager[Any]:
    if mode == "none":
        return contextlib.nullcontext()
    if mode == "empty":
        return Empty()
    if mode == "guard":
        return _ModeEngineGuard(rollout)
    raise ValueError(mode)


class _ModeEngineGuard:
    """`kvguard.guard(rollout, action="raise")` on the dispatch-mode engine: this benchmark
    measures that engine's own logic against an empty mode (`bench_suite.py` compares engines)."""

    def __init__(self, rollout: dict[str, Any]) -> None:
        self.guard = kvguard.guard(rollout, name="rollout", action="raise")

    def __enter__(self) -> Any:
        old = os.environ.get("KVGUARD_ENGINE")
        os.environ["KVGUARD_ENGINE"] = "mode"
        try:
            return self.guard.__enter__()
        finally:
            if old is None:
                del os.environ["KVGUARD_ENGINE"]
            else:
                os.environ["KVGUARD_ENGINE"] = old

    def __exit__(self, *exc: Any) -> Any:
        return self.guard.__exit__(*exc)


def _time_once(fn: Callable[[dict[str, Any]], Any], rollout: dict[str, Any], mode: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) for one run, entering and leaving the mode included.

    CPU time of this process is the primary figure: on a shared box, time spent
    descheduled while another process runs lands in wall time but not in CPU time.
    The workloads are single-threaded (torch threads = 1 by default), so for them CPU
    time is the time the work took.
    """
    gc.collect()
    gc.disable()
    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with _context(mode, rollout):
            fn(rollout)
        return time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        gc.enable()


def count_ops(fn: Callable[[dict[str, Any]], Any], rollout: dict[str, Any]) -> tuple[int, int]:
    with _Count() as c:
        fn(rollout)
    return c.ops, c.writes


def run(rounds: int = 21, quick: bool = False, warmup: int = 1, samples: int = BATCH,
        progress: Optional[Callable[[str], None]] = None) -> list[dict[str, Any]]:
    """Times every workload in every mode; returns one result dict per workload.

    Each round runs every (workload, mode) pair once; the mode order rotates from round
    to round so that no mode always runs first (cold) or last. The first `warmup`
    rounds are discarded.
    """
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    loads = workloads(quick, samples)
    # Move everything alive now (torch's import graph: ~10^5 objects) out of the
    # collector's reach, so that the gc.collect() before each timed run takes
    # microseconds rather than ~0.1 s. Undone at the end.
    gc.collect()
    gc.freeze()
    try:
        return _run(loads, rounds, warmup, progress)
    finally:
        gc.unfreeze()


def _run(loads: dict[str, tuple[Callable[[dict[str, Any]], Any], dict[str, Any]]], rounds: int, warmup: int,
         progress: Optional[Callable[[str], None]]) -> list[dict[str, Any]]:
    times: dict[str, dict[str, list[float]]] = {w: {m: [] for m in MODES} for w in loads}
    walls: dict[str, dict[str, list[float]]] = {w: {m: [] for m in MODES} for w in loads}
    for r in range(warmup + rounds):
        gc.collect()
        gc.freeze()  # again: the warm-up imported more of torch (the dispatch-mode machinery)
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for name, (fn, rollout) in loads.items():
            for mode in order:
                cpu, wall = _time_once(fn, rollout, mode)
                if r >= warmup:
                    times[name][mode].append(cpu)
                    walls[name][mode].append(wall)
        if progress is not None:
            progress(f"round {r + 1}/{warmup + rounds}{' (warm-up)' if r < warmup else ''}")
    results = []
    for name, (fn, rollout) in loads.items():
        ops, writes = count_ops(fn, rollout)
        med = {m: statistics.median(times[name][m]) * 1e3 for m in MODES}
        wall = {m: statistics.median(walls[name][m]) * 1e3 for m in MODES}
        # Per-round ratios: both modes ran back to back, so their ratio cancels slow
        # phases of the machine better than a ratio of medians does.
        per_round = [g / e for g, e in zip(times[name]["guard"], times[name]["empty"])]
        results.append({
            "workload": name,
            "ops": ops,
            "writes": writes,
            "rounds": rounds,
            "ms": med,
            "wall_ms": wall,
            "wall_guard_over_empty": wall["guard"] / wall["empty"],
            "us_per_op": {m: med[m] * 1e3 / ops for m in MODES},
            "guard_over_empty": med["guard"] / med["empty"],
            "guard_over_empty_per_round_median": statistics.median(per_round),
            "empty_over_none": med["empty"] / med["none"],
            "guard_extra_us_per_op": (med["guard"] - med["empty"]) * 1e3 / ops,
            "pass": med["guard"] / med["empty"] <= BUDGET,
        })
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    header = ("workload", "ops", "writes", "none ms", "empty ms", "guard ms",
              "guard/empty", "empty/none", "guard +us/op", f"<= {BUDGET}")
    rows = [header]
    for res in results:
        ms = res["ms"]
        rows.append((
            res["workload"], str(res["ops"]), str(res["writes"]),
            f"{ms['none']:.1f}", f"{ms['empty']:.1f}", f"{ms['guard']:.1f}",
            f"{res['guard_over_empty']:.3f}", f"{res['empty_over_none']:.2f}",
            f"{res['guard_extra_us_per_op']:+.2f}", "PASS" if res["pass"] else "FAIL",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe_machine() -> str:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"torch {torch.__version__}, python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs ({cpu}), torch threads {torch.get_num_threads()}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per mode (default 21, or 5 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller workloads (4k micro ops, GAE T=256) for smoke tests")
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if any guard/empty ratio exceeds {BUDGET}")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: less noise; ops are 1k elements)")
    parser.add_argument("--samples", type=int, default=BATCH,
                        help=f"per-sample tensors per list in the protected dict (default {BATCH}; "
                             "6 such lists, so 6*N+1 protected tensors)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (5 if args.quick else 21)

    torch.set_num_threads(args.threads)
    print(describe_machine())
    print(f"{rounds} timed rounds + 1 warm-up, modes interleaved round-robin; "
          f"median process CPU time per run; {'quick' if args.quick else 'full'} workloads; "
          f"protected dict: 8 keys, 6 lists of {args.samples} tensors")
    results = run(rounds=rounds, quick=args.quick, samples=args.samples,
                  progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(results))
    for res in results:
        print(f"{res['workload']}: us/op none {res['us_per_op']['none']:.2f}, "
              f"empty {res['us_per_op']['empty']:.2f}, guard {res['us_per_op']['guard']:.2f}; "
              f"guard/empty: median of per-round ratios {res['guard_over_empty_per_round_median']:.3f}, "
              f"wall-clock medians {res['wall_guard_over_empty']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": describe_machine(), "results": results}, f, indent=2)
    if args.check and not all(res["pass"] for res in results):
        print(f"FAIL: guard/empty above {BUDGET}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
