"""What `KVGUARD_TARGETS=weights` costs a rollout worker per load (issue 37): the vLLM-style loop.

Each step of the loop, as a vLLM worker runs it with no optimizer: the trainer's weights are
received bucket by bucket into one reused buffer (a `copy_` per weight) and yielded as views
of it to `model.load_weights(...)` (vLLM's AutoWeightsLoader over the replica's Llama in
tests/fake_frameworks/vllm), then the worker generates. Per load, both:

    step    receive + load_weights + generate (what a rollout step pays)
    load    receive + load_weights alone

Contenders, each in its own process (activation is per process), run in rounds that alternate
their order: `plain` (no kvguard) and `weights` (`KVGUARD=raise KVGUARD_TARGETS=weights`). A
child times `--loads` steps after 2 warm-up steps, in its CPU time (`time.process_time`: the
box is shared); the figure per contender is the median over rounds of each round's median
step; the ratio is weights over plain. Every child's generations are hashed: the two must be
bitwise equal, or the run says so and exits 1.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_rollout_loads.py              # ~2 min
    PYTHONPATH=. .venv/bin/python benchmarks/bench_rollout_loads.py --quick      # smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "fake_frameworks"
SIZES = {"vocab": 4096, "hidden": 256, "intermediate": 1024, "layers": 4, "batch": 8, "prompt": 16, "tokens": 16}
QUICK = {"vocab": 256, "hidden": 32, "intermediate": 64, "layers": 1, "batch": 2, "prompt": 4, "tokens": 4}
BUCKET_BYTES = 4 << 20  # a 4 MiB receive buffer, as verl's update_weights_bucket_megabytes (512 MiB) scaled down


def child(loads: int, sizes: dict[str, int]) -> None:
    """One contender's loop: print {"step": [...], "load": [...], "digest": ...} as JSON."""
    import torch
    from vllm.model_executor.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    kwargs = {k: sizes[k] for k in ("vocab", "hidden", "intermediate", "layers")}
    trainer, model = LlamaForCausalLM(**kwargs), LlamaForCausalLM(**kwargs)
    shapes = {name: p.shape for name, p in trainer.named_parameters()}
    buffer = torch.empty(BUCKET_BYTES // 4)
    buckets: list[list[tuple[str, int, int]]] = [[]]
    used = 0
    for name, p in trainer.named_parameters():
        if used + p.numel() > buffer.numel():
            buckets.append([])
            used = 0
        buckets[-1].append((name, used, p.numel()))
        used += p.numel()

    def stream():  # noqa: ANN202 - a generator of (name, view)
        sent = dict(trainer.named_parameters())
        for bucket in buckets:
            for name, offset, n in bucket:
                buffer[offset:offset + n].copy_(sent[name].detach().view(-1))
            for name, offset, n in bucket:
                yield name, buffer[offset:offset + n].view(shapes[name])

    prompt = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["prompt"]), generator=torch.Generator().manual_seed(1))
    digest = hashlib.sha256()
    steps, just_loads = [], []
    for i in range(loads + 2):
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(0.999)  # the trainer's step, untimed
        start = time.process_time()
        model.load_weights(stream())
        loaded = time.process_time()
        out = model.generate(prompt, sizes["tokens"])
        end = time.process_time()
        digest.update(out.numpy().tobytes())
        if i >= 2:
            steps.append(end - start)
            just_loads.append(loaded - start)
    print(json.dumps({"step": steps, "load": just_loads, "digest": digest.hexdigest()}))


def run(contender: str, loads: int, quick: bool) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE), str(ROOT)])}
    env.pop("KVGUARD", None)
    env.pop("KVGUARD_TARGETS", None)
    if contender == "weights":
        env.update(KVGUARD="raise", KVGUARD_TARGETS="weights")
    args = [sys.executable, __file__, "--child", "--loads", str(loads)] + (["--quick"] if quick else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{contender}: exit {done.returncode}\n{done.stderr[-3000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr.strip()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loads", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    sizes = QUICK if args.quick else SIZES
    if args.child:
        child(args.loads, sizes)
        return
    rounds = 1 if args.quick else args.rounds
    contenders = ("plain", "weights")
    per: dict[str, dict[str, list[float]]] = {c: {"step": [], "load": []} for c in contenders}
    digests: set[str] = set()
    said = ""
    for r in range(rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for contender in order:
            result = run(contender, args.loads, args.quick)
            digests.add(str(result["digest"]))
            for key in ("step", "load"):
                times = result[key]
                assert isinstance(times, list)
                per[contender][key].append(statistics.median(times))
            if contender == "weights":
                said = str(result["stderr"])
    print(f"torch {_torch_version()}, {sizes}, {args.loads} loads a process after 2 warm-up, {rounds} rounds, "
          f"CPU time, 1 thread")
    print(f"{'contender':<10} {'step ms':>9} {'load ms':>9}")
    for contender in contenders:
        step, load = (statistics.median(per[contender][k]) * 1e3 for k in ("step", "load"))
        print(f"{contender:<10} {step:>9.2f} {load:>9.2f}")
    ratio_step = statistics.median(per["weights"]["step"]) / statistics.median(per["plain"]["step"])
    ratio_load = statistics.median(per["weights"]["load"]) / statistics.median(per["plain"]["load"])
    print(f"weights / plain: step {ratio_step:.3f}x, load alone {ratio_load:.3f}x")
    print("outputs bitwise equal" if len(digests) == 1 else f"OUTPUTS DIFFER: {sorted(digests)}")
    print("weights' exit lines:\n" + said)
    if len(digests) != 1:
        raise SystemExit(1)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    main()
