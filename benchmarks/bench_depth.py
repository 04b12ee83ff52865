"""What a GRPO-shaped placement costs against the depth of the caller's stack.

`grpo(rd)` has a helper place three lists of `--tensors` tensors into a guarded rollout
dict, then writes a temporary (the guard looks there and protects the 3N new tensors).
It is called from 0, 5 and 10 trainer-like frames, each holding 60 stores into its own
dict and list, the way a training loop, a Ray actor or a schedule sits above advantage
code. The store ran in the helper, which has returned, so finding each tensor's
`placed_at` searches every frame above: the case where placements cost more the deeper
the caller. The figure is the wall
time of the call, median of `--rounds`, with the guard entered before the clock starts.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_depth.py
    PYTHONPATH=. python benchmarks/bench_depth.py --tensors 448 --rounds 5
"""

from __future__ import annotations

import argparse
import linecache
import statistics
import time
from typing import Any, Callable

import torch

import kvguard

DEPTHS = (0, 5, 10)


def _frames(n: int) -> Callable[[int, dict[str, Any]], None]:
    """frame_0(depth, rd): `depth` trainer-like frames above `grpo(rd)`."""
    def put(rd: dict[str, Any], key: str) -> None:
        rd[key] = [torch.zeros(16) for _ in range(n)]

    def grpo(rd: dict[str, Any]) -> None:
        for key in ("adv", "ret", "kl"):
            put(rd, key)
        torch.zeros(1).add_(1)  # a write: the guard looks here

    source = "def frame_{i}(depth, rd):\n    state = {{}}\n    logs = []\n" + "".join(
        f"    state['k{j}'] = {j}\n    logs.append({j})\n" for j in range(30)) + \
        "    return frame_{after}(depth - 1, rd) if depth else grpo(rd)\n"
    namespace: dict[str, Any] = {"grpo": grpo}
    for i in range(max(DEPTHS) + 1):
        # Registered with linecache: kvguard reads a frame's stores from its source, and exec'd
        # code without one would show it no stores at all (the frames would cost nothing).
        text = source.format(i=i, after=i + 1)
        filename = f"<bench_depth frame {i}>"
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        exec(compile(text, filename, "exec"), namespace)  # noqa: S102 - the benchmark's own frames
    return namespace["frame_0"]  # type: ignore[no-any-return]


def measure(n: int, rounds: int) -> tuple[float, list[float]]:
    """(unguarded ms at depth 0, guarded ms at each of DEPTHS)."""
    call = _frames(n)

    def once(depth: int, guarded: bool) -> float:
        rd: dict[str, Any] = {"obs": [torch.zeros(16) for _ in range(n)]}
        if not guarded:
            start = time.perf_counter()
            call(depth, rd)
            return time.perf_counter() - start
        with kvguard.guard(rd, name="rd", action="raise"):
            start = time.perf_counter()
            call(depth, rd)
            return time.perf_counter() - start
    unguarded = statistics.median(once(0, False) for _ in range(rounds)) * 1e3
    return unguarded, [statistics.median(once(d, True) for _ in range(rounds)) * 1e3 for d in DEPTHS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=448, help="tensors per placed list (three lists)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    unguarded, guarded = measure(args.tensors, args.rounds)
    print("tensors placed | unguarded ms | " + " | ".join(f"guarded ms, {d} frames above" for d in DEPTHS))
    print("---|---|" + "---|" * len(DEPTHS))
    print(f"{3 * args.tensors:,} | {unguarded:.1f} | " + " | ".join(f"{g:.1f}" for g in guarded))


if __name__ == "__main__":
    main()
