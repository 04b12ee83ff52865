"""kvguard on a CUDA GPU: one short script, for a machine that has one (never run in CI).

    python benchmarks/gpu_check.py [--rounds 20] [--device cuda]

`--device cpu` runs the same checks where they apply (no sync check), as a smoke test.

Checks, on CUDA tensors:
1. the guard catches the in-place KL bug (raise: blocked, data intact; record: the diff);
2. a guarded call that writes nothing protected makes no host-device synchronisation
   inside the block (`torch.cuda.set_sync_debug_mode("error")` around the guarded code;
   the exit's fingerprint comparison synchronises once per device, which is checked
   separately and reported);
3. before-snapshots and fingerprints stay on the device (no CPU copies of protected data);
4. the guarded/unguarded time of the example pipeline, fingerprints on and off, full and
   light level.

Prints one line per check, `ok` or `FAILED`, and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch

import kvguard
from kvguard._protect import digest as _digest

results: list[tuple[str, bool, str]] = []
DEVICE = "cuda"


def check(name: str, ok: bool, detail: str = "") -> None:
    results.append((name, ok, detail))
    print(f"{'ok    ' if ok else 'FAILED'} {name}{': ' + detail if detail else ''}", flush=True)


def rollout(n: int = 64, t: int = 512) -> dict[str, Any]:
    device = DEVICE
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "log_probs": [torch.randn(t, device=device, generator=g) for _ in range(n)],
        "ref_log_probs": [torch.randn(t, device=device, generator=g) for _ in range(n)],
        "rewards": [float(i % 2) for i in range(n)],
    }


def advantages(rollout_data: dict[str, Any], bug: bool, kl_coef: float = 0.05, gamma: float = 1.0,
               lam: float = 0.95) -> list[torch.Tensor]:
    """PPO-style reward shaping and GAE, per sample, as RL trainers write it."""
    kl = [lp - ref for lp, ref in zip(rollout_data["log_probs"], rollout_data["ref_log_probs"])]
    rollout_data["kl"] = kl
    out = []
    for k, reward in zip(kl, rollout_data["rewards"]):
        if bug:
            k *= -kl_coef  # the bug: k IS rollout_data["kl"][i]
            k[-1] += reward
            rewards = k
        else:
            rewards = k * -kl_coef
            rewards[-1] += reward
        adv = torch.zeros_like(rewards)
        last = torch.zeros((), device=rewards.device)
        for i in range(rewards.numel() - 1, -1, -1):
            last = rewards[i] + gamma * lam * last
            adv[i] = last
        out.append(adv)
    return out


def catches_the_bug() -> None:
    data = rollout(4, 64)
    with kvguard.guard(data, name="rollout_data", action="record") as g:
        advantages(data, bug=True)
    first = g.report.events[0] if g.report.events else None
    check(f"record: the bug is reported on {DEVICE}", first is not None and first.path == "rollout_data['kl'][0]"
          and first.op == "aten.mul_.Tensor", first.headline() if first else "no event")
    data = rollout(4, 64)
    kept = [t.clone() for t in data["log_probs"]]
    try:
        with kvguard.guard(data, name="rollout_data", action="raise"):
            data["log_probs"][0].mul_(2)
        check("raise: blocked before the write", False, "no MutationError")
    except kvguard.MutationError:
        check("raise: blocked before the write", torch.equal(data["log_probs"][0], kept[0]))


def no_sync_inside_a_clean_guard() -> None:
    data = rollout(8, 256)
    advantages(data, bug=False)  # warm up kernels and allocator
    torch.cuda.synchronize()
    g = kvguard.guard(data, name="rollout_data", action="raise")
    g.__enter__()
    failure = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        advantages(data, bug=False)
    except RuntimeError as exc:
        failure = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check("a clean guarded call: no host-device sync inside the block", not failure, failure)
    torch.cuda.set_sync_debug_mode("warn")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.__exit__(None, None, None)
    torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    check("guard exit: fingerprint comparison syncs", True, f"{len(syncs)} synchronising call(s) at exit")


def stays_on_device() -> None:
    x = torch.randn(1 << 20, device=DEVICE)
    (digest,) = _digest.digests([x])
    on_device = isinstance(digest, torch.Tensor) and digest.device.type == DEVICE
    check("fingerprints stay on the device", on_device or DEVICE == "cpu",
          f"digest is {type(digest).__name__} on {getattr(digest, 'device', 'host')}")
    data = {"x": x}
    with kvguard.guard(data, name="d", action="record") as g:
        x.mul_(2)
    from kvguard._engine import diff as _diff

    snap = _diff.snapshot(x)
    where = getattr(snap, "device", None)
    check("before-snapshots stay on the device", where is None or where.type == DEVICE, f"snapshot on {where}")
    check("a reported write has its diff", bool(g.report.events) and "changed" in g.report.events[0].diff,
          g.report.events[0].diff[:80] if g.report.events else "no event")


def timing(rounds: int) -> None:
    def sync() -> None:
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    def run(make: Callable[[dict[str, Any]], Any]) -> float:
        data = rollout(16, 128)
        sync()
        start = time.perf_counter()
        with make(data):
            advantages(data, bug=False)
        sync()
        return time.perf_counter() - start

    class Off:
        def __init__(self, data: Any) -> None: ...
        def __enter__(self) -> None: ...
        def __exit__(self, *exc: Any) -> None: ...

    cases: dict[str, Callable[[Any], Any]] = {
        "unguarded": Off,
        "full, fingerprints on": lambda d: kvguard.guard(d, name="rd", action="record"),
        "full, fingerprints off": lambda d: kvguard.guard(d, name="rd", action="record", fingerprint=False),
        "light": lambda d: kvguard.guard(d, name="rd", action="record", level="light"),
    }
    for make in cases.values():
        run(make)  # warm up
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, make in cases.items():
            times[name].append(run(make))
    for name, ts in times.items():
        ratio = statistics.median(t / u for t, u in zip(ts, times["unguarded"]))
        print(f"       {name:28s} {statistics.median(ts) * 1e3:8.1f} ms   {ratio:5.2f}x unguarded")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    opts = parser.parse_args()
    global DEVICE
    DEVICE = opts.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (or --device cpu for a smoke run)")
        return 2
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {name}, kvguard {kvguard.__version__}")
    catches_the_bug()
    if DEVICE == "cuda":
        no_sync_inside_a_clean_guard()
    stays_on_device()
    timing(opts.rounds)
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
