"""What `kvguard.guard_module()` costs on a training step.

Alternates, round by round, `bench_suite.py`'s transformer training step unguarded and
with `guard_module(model, optimizer=opt, action="raise")` open around the loop (as
`KVGUARD_TARGETS=weights` leaves it), `compiled` engine, fingerprints on and off. CPU
time, medians of per-round times; the ratios are what to read.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_weights.py            # ~1 min
    PYTHONPATH=. .venv/bin/python benchmarks/bench_weights.py --quick    # smoke
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
import kvguard  # noqa: E402
from bench_suite import build_train, train_step  # noqa: E402

LM = {"vocab": 2048, "d": 128, "layers": 2, "heads": 4, "ff": 512, "seq": 128, "batch": 8, "logged": 64}
QUICK = {"vocab": 256, "d": 32, "layers": 1, "heads": 2, "ff": 64, "seq": 16, "batch": 2, "logged": 4}
STEPS = 3  # steps per timed run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fused", action="store_true", help="AdamW fused=True (default foreach)")
    args = parser.parse_args()
    os.environ.setdefault("KVGUARD_ENGINE", "compiled")
    torch.set_num_threads(1)
    state = build_train(QUICK if args.quick else LM, fused=args.fused)

    def run(contender: str) -> float:
        gc.collect(1)
        guard: Any = None
        if contender != "unguarded":
            guard = kvguard.guard_module(state["model"], optimizer=state["opt"], action="raise",
                                         fingerprint=contender == "guard_module")
            guard.__enter__()
        start = time.process_time()
        for _ in range(STEPS):
            train_step(state)
        elapsed = time.process_time() - start
        if guard is not None:
            guard.__exit__(None, None, None)
            assert guard.report.ok, guard.report.format()
        state["protected"]["train/loss"].clear()
        state["protected"]["train/grad_norm"].clear()
        return elapsed / STEPS

    contenders = ["unguarded", "guard_module", "guard_module, fp off"]
    for name in contenders:
        run(name)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(2 if args.quick else args.rounds):
        for name in contenders[r % 3:] + contenders[:r % 3]:
            times[name].append(run(name))
    base = statistics.median(times["unguarded"])
    params = sum(1 for _ in state["model"].parameters())
    print(f"training step ({'fused' if args.fused else 'foreach'} AdamW), {params} parameters, "
          f"{len(times['unguarded'])} rounds of {STEPS} steps, CPU time per step")
    print("contender              median ms   / unguarded")
    for name in contenders:
        med = statistics.median(times[name])
        print(f"{name:<22} {med * 1e3:9.2f}   {med / base:9.3f}")


if __name__ == "__main__":
    main()
