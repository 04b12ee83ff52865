"""Peak memory of a training step with `KVGUARD_TARGETS=autograd,weights` on, against without.

Each run is a fresh process: 5 steps of a 6-layer MLP (1024 wide, LayerNorm and GELU,
batch 2,048: about 200 MB of saved activations per step) with AdamW; the figure is the
process's peak resident memory (`ru_maxrss`) less what it held before the first step.
Runs alternate between the two settings.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py --runs 3    # ~1 min
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

STEP = """
import resource, torch
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                                                  torch.nn.LayerNorm(1024)) for _ in range(6)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(2048, 1024)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for _ in range(5):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def peak_mb(targets: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD") or k == "KVGUARD_CACHE_DIR"}
    if targets:
        env.update(KVGUARD="raise", KVGUARD_TARGETS=targets)
    out = subprocess.run([sys.executable, "-c", STEP], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    plain, guarded = [], []
    for _ in range(args.runs):
        plain.append(peak_mb(None))
        guarded.append(peak_mb("autograd,weights"))
    p, g = statistics.median(plain), statistics.median(guarded)
    print(f"peak memory of 5 training steps above the start, median of {args.runs} fresh processes (MB)")
    print(f"  unguarded                          {p:8.1f}   runs: {', '.join(f'{v:.0f}' for v in plain)}")
    print(f"  KVGUARD_TARGETS=autograd,weights   {g:8.1f}   runs: {', '.join(f'{v:.0f}' for v in guarded)}")
    print(f"  ratio                              {g / p:8.3f}")


if __name__ == "__main__":
    main()
