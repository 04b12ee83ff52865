"""What value fingerprints cost: digest throughput against cloning, and guard entry/exit with them.

    python benchmarks/bench_digest.py [--rounds 7] [--mb 256] [--tensors 1500]

Interleaved rounds, medians; ratios are taken within a round (the machine is shared and
noisy, absolute times drift). The garbage collector stays on, as users run it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import kvguard
from kvguard._protect import digest as _digest


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def throughput(mb: int, rounds: int) -> None:
    big = torch.randn(mb * (1 << 20) // 4)
    half = torch.randn(2, mb * (1 << 20) // 8).t()  # strided: every other element of a row
    cases = {
        "digest (C, one pass)": lambda: _digest.digests([big]),
        "digest, strided view": lambda: _digest.digests([half]),
        "digest (torch fallback)": lambda: _digest._torch_digest(big),
        "clone": lambda: big.clone(),
        "clone + torch.equal": lambda: torch.equal(big, big.clone()),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(_time(fn))
    print(f"## digest throughput, one {mb} MB float32 tensor, median of {rounds} rounds\n")
    print("| case | MB/s | time vs clone |")
    print("|---|---|---|")
    for name, ts in times.items():
        nbytes = half.nbytes if "strided" in name else big.nbytes
        ratio = statistics.median(t / c for t, c in zip(ts, times["clone"]))
        print(f"| {name} | {nbytes / 1e6 / statistics.median(ts):,.0f} | {ratio:.2f} |")


def entry_exit(n: int, rounds: int) -> None:
    tensors = {"kl": [torch.randn(256) for _ in range(n)]}

    def guarded(fingerprint: bool) -> Callable[[], object]:
        def run() -> None:
            with kvguard.guard(tensors, name="rd", action="record", fingerprint=fingerprint):
                pass
        return run

    cases = {
        "guard, fingerprints on": guarded(True),
        "guard, fingerprints off": guarded(False),
        "guard, light level": lambda: kvguard.guard(tensors, name="rd", action="record", level="light").__enter__().__exit__(None, None, None),
        "digests alone (twice)": lambda: (_digest.digests(tensors["kl"]), _digest.digests(tensors["kl"])),
        "clone all + compare": lambda: [torch.equal(c, t) for c, t in zip([t.clone() for t in tensors["kl"]], tensors["kl"])],
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(_time(fn))
    print(f"\n## guard entry + exit over {n} tensors of 1 KB, gc on, {rounds} rounds\n")
    print("Median, and mean (which spreads the garbage collector's full passes over the rounds).\n")
    print("| case | µs per tensor, median | µs per tensor, mean | mean vs clone + compare |")
    print("|---|---|---|---|")
    base = statistics.mean(times["clone all + compare"])
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) / n * 1e6:.2f} | {statistics.mean(ts) / n * 1e6:.2f} "
              f"| {statistics.mean(ts) / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=1500)
    opts = parser.parse_args()
    throughput(opts.mb, opts.rounds)
    entry_exit(opts.tensors, opts.rounds)


if __name__ == "__main__":
    main()
