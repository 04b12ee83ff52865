"""What kvguard costs around `torch.compile`d code: a compiled optimizer step's calls, and compile time.

Two measurements, each side by side in one run:

* **step**: a compiled AdamW step (`torch.compile(lambda: opt.step())`) over `--layers`
  Linear(32, 32) layers, in one process: unguarded, then under `guard_module(model, opt)`,
  interleaved rounds, the median of each round's median. Every call of the compiled graph
  mutates each parameter and its two moments, so this is the per-input cost of judging
  compiled graphs' writes (one C pass, `write_hook.candidates`) plus the step bookkeeping
  eager steps pay too; the eager step's ratio is measured beside it.
* **compile**: a compiled model, loss and optimizer step, 3 training steps, each run in a
  fresh process with an empty inductor cache: plain, and `KVGUARD=raise
  KVGUARD_TARGETS=autograd,weights,data`. CPU-seconds of the process and its children
  (inductor's compile workers), start-up included: robust on a busy machine where wall
  time is not.

    python benchmarks/bench_compiled.py            # both, about 3 minutes on 2 cores
    python benchmarks/bench_compiled.py --only step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_STEP = r"""
import json, sys, time, torch, kvguard
torch.manual_seed(0)
torch.set_num_threads(1)
layers, rounds, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for p in model.parameters():
    p.grad = torch.randn_like(p)
compiled = torch.compile(lambda: opt.step())
eager = lambda: opt.step()

def per_call(step):
    t = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - t) / calls * 1e6

out = {"compiled": {"plain": [], "guarded": []}, "eager": {"plain": [], "guarded": []}}
with kvguard.guard_module(model, optimizer=opt, action="raise"):
    compiled(); eager()  # the step wrapper is on the instance: Dynamo compiles that once
for kind, step in (("compiled", compiled), ("eager", eager)):
    for _ in range(rounds):
        out[kind]["plain"].append(per_call(step))
        with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
            out[kind]["guarded"].append(per_call(step))
        assert g.report.events == []
print("RESULT" + json.dumps(out))
"""

_LOOP = r"""
import json, resource, torch, warnings
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
cmodel = torch.compile(model)
loss_fn = torch.compile(lambda out, y: torch.nn.functional.cross_entropy(out, y))
step = torch.compile(lambda: opt.step())
losses = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(3):
        x = torch.randn(8, 16); y = torch.randint(0, 4, (8,))
        loss = loss_fn(cmodel(x), y)
        loss.backward()
        step()
        opt.zero_grad()
        losses.append(loss.item())
from torch._dynamo.utils import counters
used = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
print("RESULT" + json.dumps({"cpu_s": sum(u.ru_utime + u.ru_stime for u in used), "losses": losses,
      "frames": counters["frames"]["total"], "graph_breaks": sum(counters["graph_break"].values()),
      "graphs": counters["stats"]["unique_graphs"],
      "warnings": sorted({str(w.message)[:60] for w in caught if w.category is not DeprecationWarning})}))
"""


def _run(code: str, args: list[str], env: dict[str, str]) -> dict:
    """What the process printed after RESULT, and its stderr (kvguard's exit lines)."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **env})
    if proc.returncode != 0:
        raise SystemExit(f"the benchmark process failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return {**json.loads(line[len("RESULT"):]), "stderr": proc.stderr}


def compiled_loop(env: dict[str, str]) -> dict:
    """The compiled training loop in a fresh process with `env`: losses, Dynamo's counters,
    warnings, CPU-seconds, stderr (tests/test_compiled_code.py compares two such runs)."""
    return _run(_LOOP, [], env)


def step(layers: int, rounds: int, calls: int) -> None:
    out = _run(_STEP, [str(layers), str(rounds), str(calls)], {"OMP_NUM_THREADS": "1"})
    print(f"step: AdamW over {layers} x Linear(32, 32) (each compiled call writes every parameter and its state), "
          f"{rounds} interleaved rounds of {calls} calls, median us per step")
    for kind in ("compiled", "eager"):
        plain, guarded = (statistics.median(out[kind][k]) for k in ("plain", "guarded"))
        print(f"  {kind:8} plain {plain:8.0f}  guard_module {guarded:8.0f}  ratio {guarded / plain:.2f}")


def compile_time(rounds: int) -> None:
    guarded_env = {"KVGUARD": "raise", "KVGUARD_TARGETS": "autograd,weights,data"}
    results: dict[str, list[dict]] = {"plain": [], "guarded": []}
    for _ in range(rounds):
        for name, env in (("plain", {}), ("guarded", guarded_env)):
            with tempfile.TemporaryDirectory() as cache:
                started = time.perf_counter()
                found = compiled_loop({"TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1", **env})
                found["wall_s"] = time.perf_counter() - started
                results[name].append(found)
    print(f"compile: a compiled model, loss and AdamW step, 3 steps, fresh process and inductor cache, {rounds} "
          f"interleaved rounds")
    for name in ("plain", "guarded"):
        cpu = [r["cpu_s"] for r in results[name]]
        first = results[name][0]
        print(f"  {name:8} CPU-s {' '.join(f'{c:.1f}' for c in cpu)}  frames {first['frames']}  "
              f"graph breaks {first['graph_breaks']}  graphs {first['graphs']}")
    ratio = statistics.median(r["cpu_s"] for r in results["guarded"]) / statistics.median(
        r["cpu_s"] for r in results["plain"])
    same = all(a["losses"] == b["losses"] for a, b in zip(results["plain"], results["guarded"]))
    print(f"  CPU-seconds ratio {ratio:.2f}; losses bitwise equal: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("step", "compile"))
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    if args.only in (None, "step"):
        step(args.layers, args.rounds, args.calls)
    if args.only in (None, "compile"):
        compile_time(args.rounds)


if __name__ == "__main__":
    main()
