"""What `kvguard.guard_module()` costs on a training step.

Alternates, round by round, a training step unguarded and with `guard_module(model,
optimizer=opt, action="raise")` open around the loop (as `KVGUARD_TARGETS=weights` leaves
it), `compiled` engine, fingerprints on and off. CPU time, medians of per-round times; the
ratios are what to read. The step (`--shape`):

    lm          `bench_suite.py`'s transformer (the default; AdamW foreach, or --fused)
    bn1d        50 x (Linear(16, 16), BatchNorm1d(16)), batch 4, AdamW for-loop (torch's
                CPU default): 100 batch-norm statistics writes a step, each allowed
    bn2d        50 x (Conv2d(8, 8, 1), BatchNorm2d(8)), 2 x 8 x 4 x 4, AdamW for-loop
    resnet18    timm ResNet-18, 4 x 3 x 32 x 32, AdamW for-loop (20 batch norms);
                timm from --vision-path (`bench_real_models.py`'s torchvision shim)

    PYTHONPATH=. .venv/bin/python benchmarks/bench_weights.py            # ~1 min
    PYTHONPATH=. .venv/bin/python benchmarks/bench_weights.py --shape bn2d --rounds 9
    PYTHONPATH=. .venv/bin/python benchmarks/bench_weights.py --shape resnet18 --vision-path /work/kvw-timm
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
from bench_suite import build_train  # noqa: E402
from bench_suite import train_step as suite_step  # noqa: E402

LM = {"vocab": 2048, "d": 128, "layers": 2, "heads": 4, "ff": 512, "seq": 128, "batch": 8, "logged": 64}
QUICK = {"vocab": 256, "d": 32, "layers": 1, "heads": 2, "ff": 64, "seq": 16, "batch": 2, "logged": 4}
STEPS = 3  # steps per timed run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fused", action="store_true", help="AdamW fused=True (default foreach)")
    parser.add_argument("--shape", default="lm", choices=["lm", "bn1d", "bn2d", "resnet18"])
    parser.add_argument("--vision-path", default=None, help="where timm and torchvision are installed (resnet18)")
    args = parser.parse_args()
    os.environ.setdefault("KVGUARD_ENGINE", "compiled")
    torch.set_num_threads(1)
    state = build_train(QUICK if args.quick else LM, fused=args.fused) if args.shape == "lm" else (
        build_norms(args.shape, args.vision_path))

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
        if "protected" in state:
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
    what = args.shape if args.shape != "lm" else f"{'fused' if args.fused else 'foreach'} AdamW"
    print(f"training step ({what}), {params} parameters, "
          f"{len(times['unguarded'])} rounds of {STEPS} steps, CPU time per step")
    print("contender              median ms   / unguarded")
    for name in contenders:
        med = statistics.median(times[name])
        print(f"{name:<22} {med * 1e3:9.2f}   {med / base:9.3f}")


def build_norms(shape: str, vision_path: Any) -> dict[str, Any]:
    """A batch-norm-heavy model and its step (`--shape`), in `train_step`'s state form."""
    torch.manual_seed(0)
    model: torch.nn.Module
    if shape == "bn1d":
        model = torch.nn.Sequential(*[m for _ in range(50) for m in (torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))])
        x = torch.randn(4, 16)
    elif shape == "bn2d":
        model = torch.nn.Sequential(*[m for _ in range(50) for m in (torch.nn.Conv2d(8, 8, 1), torch.nn.BatchNorm2d(8))])
        x = torch.randn(2, 8, 4, 4)
    else:
        if vision_path:
            sys.path.insert(0, vision_path)
        from bench_real_models import _torchvision_importable

        _torchvision_importable()
        import timm

        model = timm.create_model(shape, pretrained=False, num_classes=10)
        x = torch.randn(4, 3, 32, 32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"model": model, "opt": opt, "step": step}


def train_step(state: dict[str, Any]) -> None:
    if "step" in state:
        state["step"]()
    else:
        suite_step(state)


if __name__ == "__main__":
    main()
