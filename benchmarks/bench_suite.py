"""kvguard against its peers: one command, every ratio measured side by side in one run.

    PYTHONPATH=. python benchmarks/bench_suite.py --size realistic        # the README table
    PYTHONPATH=. python benchmarks/bench_suite.py --size ci --rounds 1    # smoke (the test)
    PYTHONPATH=. python benchmarks/bench_suite.py --only micro --rounds 9

Workloads (none of them writes protected memory; each protects what a user would):

* ``adv_*``: the advantage pipeline as Megatron-style RL trainers write it
  (slime's ``compute_advantages_and_returns(args, rollout_data)``): per-sample lists in a
  ``rollout_data`` dict, a k1 KL estimate placed into it, KL shaping **out of place**
  (``r = -kl_coef * k``, then the sequence reward added to the new tensor's last token),
  then one estimator, then masked whitening over every token of the batch; advantages
  and returns are placed into the dict. Estimators: PPO with GAE as a per-token Python
  loop over the padded ``[B, T]`` batch (``for t in reversed(range(T))``, as verl and
  slime write it: the realistic cost, 2048 iterations); GRPO (group-normalised
  sequence rewards broadcast to tokens); REINFORCE++ with gamma = 1, the reverse
  cumulative sum vectorised per sample (``flip``/``cumsum``/``flip``). ``adv_wide``
  is PPO with GAE over 512 samples (3,073 protected tensors). ``adv_grpo_deep`` is
  ``adv_grpo``'s call made 20 trainer-like frames down (60 stores each), then one write
  to a temporary: a placement must cost the same whatever the caller's stack.
* ``train_*``: a small pre-norm transformer LM, one training step (forward,
  cross-entropy, backward, ``clip_grad_norm_``, AdamW ``foreach=True`` or
  ``fused=True``, ``zero_grad``), with a metrics dict of logged rollout statistics
  protected across the step; the step appends its loss and grad norm to it.
* ``micro_*``: loops of 2k-element ops on tensors read from the protected rollout:
  out-of-place only; one op in five in place on a temporary; every op in place on a
  temporary.
* ``entry_exit_*``: entering and leaving the contender around an empty body, over one
  tensor of 1 MB / 100 MB / 1 GB, and over 49 / 1,500 / 15,000 / 100,000 tensors of
  1 KB in per-sample lists. These rows are read against clone-and-compare.

Contenders: unguarded; an empty ``TorchDispatchMode``; ``kvguard.guard`` at level
"full" with fingerprints on and off, and at level "light"; clone every protected
tensor at entry and ``torch.equal`` each at exit; ``SchemaCheckMode``; ``DebugMode``.

Method: one warm-up round (discarded; it also finds contenders that cannot run a
workload), then ``--rounds`` timed rounds, the whole thing ``--repeats`` times (default
2) so that the spread shows. Each round runs every (workload, contender) pair once, the
contender order rotating from round to round. A run is timed in process CPU time
(``time.process_time``: time spent descheduled on this shared box does not count),
entering and leaving the contender included. The garbage collector stays on and is not
frozen, as users run it (full passes then traverse torch's ~5e5 live objects, as they do
in a training job); untimed, a full ``gc.collect()`` runs at the start of each round and
``gc.collect(1)`` before each run, so that no run pays for another's garbage. A cell is the median over rounds of the per-round ratio
(contender / unguarded in the same round; for entry/exit rows, contender /
clone-and-compare), one figure per repeat: ``repeat 1 / repeat 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import linecache
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kvguard

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------
# Contenders


class EmptyMode(TorchDispatchMode):
    """The floor for any Python dispatch mode: only calls the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class CloneCompare:
    """The do-it-yourself check: clone every protected tensor at entry, compare at exit."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> "CloneCompare":
        self.pairs = [(t, t.clone()) for t in tree_leaves(self.obj) if isinstance(t, torch.Tensor)]
        return self

    def __exit__(self, *exc: Any) -> None:
        pairs, self.pairs = self.pairs, []
        changed = sum(1 for t, c in pairs if not torch.equal(t, c))
        if changed and exc[0] is None:
            raise AssertionError(f"clone + compare: {changed} protected tensors changed")


def _schema_check_mode() -> type:
    from torch._subclasses.schema_check_mode import SchemaCheckMode
    return SchemaCheckMode


def _debug_mode() -> type:
    from torch.utils._debug_mode import DebugMode  # torch 2.13: a package, DebugMode re-exported
    return DebugMode


def _kv(engine: str, **options: Any) -> Callable[[Any], ContextManager[Any]]:
    """A kvguard guard whose writes the given engine finds (`KVGUARD_ENGINE`)."""
    def factory(obj: Any) -> ContextManager[Any]:
        os.environ["KVGUARD_ENGINE"] = engine
        return kvguard.guard(obj, name="rollout_data", action="raise", **options)
    return factory


# key, column header, factory(protected object) -> context manager
CONTENDERS: list[tuple[str, str, Callable[[Any], ContextManager[Any]]]] = [
    ("unguarded", "unguarded", lambda obj: contextlib.nullcontext()),
    ("idle", "kvguard installed, no guard", lambda obj: contextlib.nullcontext()),
    ("empty", "empty mode", lambda obj: EmptyMode()),
    ("kv_compiled", "kvguard compiled", _kv("compiled", level="full", fingerprint=True)),
    ("kv_kernels", "kvguard kernels", _kv("kernels", level="full", fingerprint=True)),
    ("kv_mode", "kvguard mode", _kv("mode", level="full", fingerprint=True)),
    ("kv_full_nofp", "kvguard compiled, fp off", _kv("compiled", level="full", fingerprint=False)),
    ("kv_light", "kvguard light", _kv("mode", level="light")),
    ("clone_compare", "clone + compare", CloneCompare),
    ("schema_check", "SchemaCheckMode", lambda obj: _schema_check_mode()()),
    ("debug_mode", "DebugMode", lambda obj: _debug_mode()()),
]
# The write hook each contender runs with, installed (untimed) before its run: none for
# the baselines and the peers, so "unguarded" is torch as it ships.
HOOK_OF = {"idle": "compiled", "kv_compiled": "compiled", "kv_kernels": "kernels", "kv_full_nofp": "compiled"}
CONTENDER_KEYS = [key for key, _, _ in CONTENDERS]
SLOW_PEERS = ("schema_check", "debug_mode")  # timed once when a run takes over --max-seconds
HEADERS = {key: header for key, header, _ in CONTENDERS}

# ---------------------------------------------------------------------------------------
# Sizes

SIZES: dict[str, dict[str, Any]] = {
    "ci": {
        "samples": 8, "seq": 64, "per_prompt": 4, "wide_samples": 32,
        "lm": {"vocab": 64, "d": 16, "layers": 1, "heads": 2, "ff": 32, "seq": 8, "batch": 2, "logged": 8},
        "micro_ops": 200,
        "bytes": [(1 << 20, 1), (100 << 20, 1)],
        "counts": [(49, 2), (1500, 1)],
        "rounds": 1,
    },
    "realistic": {
        "samples": 64, "seq": 2048, "per_prompt": 8, "wide_samples": 512,
        "lm": {"vocab": 2048, "d": 128, "layers": 2, "heads": 4, "ff": 512, "seq": 128, "batch": 8, "logged": 64},
        "micro_ops": 20_000,
        # (bytes, repetitions of entry+exit inside one timed run)
        "bytes": [(1 << 20, 20), (100 << 20, 1), (1 << 30, 1)],
        "counts": [(49, 20), (1500, 2), (15_000, 1), (100_000, 1)],
        "rounds": 7,
    },
}

# ---------------------------------------------------------------------------------------
# Workloads


@dataclass
class Workload:
    name: str
    kind: str                              # "ratio" (vs unguarded) or "entry_exit" (vs clone + compare)
    what: str                              # a few words for the table
    build: Callable[[], dict[str, Any]]    # state; built once, before the rounds
    run: Callable[[dict[str, Any]], Any]   # the guarded region's body
    reset: Callable[[dict[str, Any]], None] = lambda state: None  # untimed, after each run
    inner: int = 1                         # body + entry/exit repetitions per timed run
    tensors: int = 0                       # protected tensors (entry/exit rows: per-tensor cost)
    nbytes: int = 0
    state: dict[str, Any] = field(default_factory=dict)


def make_rollout(samples: int, seq: int, seed: int = 0, prompt: int = 64) -> dict[str, Any]:
    """rollout_data as Megatron-style trainers hold it: per-sample lists, one tensor per sample."""
    g = torch.Generator().manual_seed(seed)

    def per_sample(make: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
        return [make() for _ in range(samples)]

    return {
        "tokens": per_sample(lambda: torch.randint(0, 32000, (prompt + seq,), generator=g)),
        "response_lengths": [seq] * samples,
        "total_lengths": [prompt + seq] * samples,
        "values": per_sample(lambda: torch.randn(seq, generator=g)),
        "log_probs": per_sample(lambda: -torch.rand(seq, generator=g) * 3),
        "ref_log_probs": per_sample(lambda: -torch.rand(seq, generator=g) * 3),
        "loss_masks": per_sample(lambda: (torch.rand(seq, generator=g) > 0.05).float()),
        "raw_reward": torch.randn(samples, generator=g),
    }


PLACED = ("kl", "advantages", "returns")


def _unplace(state: dict[str, Any]) -> None:
    for key in PLACED:
        state["rollout_data"].pop(key, None)


def gae_batched(rewards: list[torch.Tensor], values: list[torch.Tensor], gamma: float,
                lam: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE over the padded batch, one Python iteration per token (verl / slime style)."""
    r = torch.stack(rewards)
    v = torch.stack(values)
    batch, seq = r.shape
    lastgaelam = torch.zeros(batch)
    advantages_reversed = []
    for t in reversed(range(seq)):
        next_values = v[:, t + 1] if t < seq - 1 else 0.0
        delta = r[:, t] + gamma * next_values - v[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    adv = torch.stack(advantages_reversed[::-1], dim=1)
    ret = adv + v
    return list(adv.unbind(0)), list(ret.unbind(0))


def compute_advantages_and_returns(rollout_data: dict[str, Any], estimator: str, per_prompt: int,
                                   kl_coef: float = 0.05, gamma: float = 1.0, lam: float = 0.95) -> None:
    """The advantage pipeline, written as trainer code (no write to anything protected)."""
    log_probs = rollout_data["log_probs"]
    ref_log_probs = rollout_data["ref_log_probs"]
    loss_masks = rollout_data["loss_masks"]
    raw_reward = rollout_data["raw_reward"]

    kl = [lp - rlp for lp, rlp in zip(log_probs, ref_log_probs)]  # k1 estimator
    rollout_data["kl"] = kl

    if estimator == "ppo_gae":
        token_rewards = []
        for i, k in enumerate(kl):
            r = -kl_coef * k          # KL shaping out of place (the fix of the in-place bug)
            r[-1] += raw_reward[i]    # sequence reward on the last token: writes the new tensor
            token_rewards.append(r)
        advantages, returns = gae_batched(token_rewards, rollout_data["values"], gamma, lam)
    elif estimator == "grpo":
        grouped = raw_reward.view(-1, per_prompt)
        normed = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)
        normed = normed.flatten()
        returns = [torch.ones_like(k) * normed[i] for i, k in enumerate(kl)]
        advantages = returns
    elif estimator == "reinforce_pp":
        returns = []
        for i, k in enumerate(kl):
            r = -kl_coef * k
            r[-1] += raw_reward[i]
            returns.append(r.flip(0).cumsum(0).flip(0))  # reverse cumulative sum, gamma = 1
        advantages = returns
    else:
        raise ValueError(estimator)

    # whitening over every token of the batch, masked
    all_adv = torch.cat(advantages)
    all_mask = torch.cat(loss_masks)
    n = all_mask.sum()
    mean = (all_adv * all_mask).sum() / n
    var = ((all_adv - mean) ** 2 * all_mask).sum() / n
    rstd = torch.rsqrt(var + 1e-8)
    rollout_data["advantages"] = [(a - mean) * rstd * m for a, m in zip(advantages, loss_masks)]
    rollout_data["returns"] = returns


DEEP_FRAMES = 20        # trainer-like frames above the call in adv_grpo_deep
STORES_PER_FRAME = 60


def deep_caller(frames: int = DEEP_FRAMES, stores: int = STORES_PER_FRAME) -> Callable[[dict[str, Any], int], None]:
    """frame_0(rollout_data, per_prompt): the GRPO call of `adv_grpo`, `frames` frames down.

    Each frame stores `stores` values into its own dict and object (two in three
    ``state["xJ"] = J``, one in three ``step.aJ = J``), as a training loop, a Ray actor or
    a schedule does above advantage code, then calls the next. GRPO itself writes
    nothing, so the innermost frame then writes a temporary, as the trainer's next op
    would: the guard looks there, with every frame still on the stack (without it, it
    would first look at exit, the frames gone). The generated source is registered with
    `linecache`: kvguard reads a frame's stores from its source, and exec'd code with
    none would show it no stores at all.
    """
    lines: list[str] = []
    for i in range(frames):
        lines += [f"def frame_{i}(rollout_data, per_prompt):", "    state = {}", "    step = Step()"]
        lines += [f"    step.a{j} = {j}" if j % 3 == 2 else f"    state['x{j}'] = {j}" for j in range(stores)]
        if i + 1 < frames:
            lines.append(f"    frame_{i + 1}(rollout_data, per_prompt)")
        else:
            lines += ["    compute_advantages_and_returns(rollout_data, 'grpo', per_prompt)",
                      "    torch.zeros(1).add_(1.0)  # the trainer's next write: the guard looks here"]
    source = "\n".join(lines) + "\n"
    filename = f"<bench_suite: {frames} trainer frames, {stores} stores each>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {**globals(), "Step": types.SimpleNamespace}  # a module's worth of globals
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - the benchmark's own frames
    return namespace["frame_0"]  # type: ignore[no-any-return]


class TinyLM(nn.Module):
    """A small pre-norm transformer language model."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ff: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.causal, is_causal=True)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def build_train(lm: dict[str, int], fused: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM(lm["vocab"], lm["d"], lm["layers"], lm["heads"], lm["ff"], lm["seq"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                            foreach=None if fused else True, fused=True if fused else None)
    g = torch.Generator().manual_seed(1)
    n = lm["logged"]
    metrics = {  # what the trainer logged about the rollout, protected across the step
        "rollout/raw_reward": torch.randn(n, generator=g),
        "rollout/response_length": torch.randint(1, 2048, (n,), generator=g),
        "rollout/kl": [torch.randn((), generator=g) for _ in range(n)],
        "rollout/entropy": [torch.rand(lm["seq"], generator=g) for _ in range(n)],
        "train/loss": [],
        "train/grad_norm": [],
    }
    batch = torch.randint(0, lm["vocab"], (lm["batch"], lm["seq"] + 1), generator=g)
    return {"model": model, "opt": opt, "batch": batch, "protected": metrics, "vocab": lm["vocab"]}


def train_step(state: dict[str, Any]) -> None:
    model, opt, batch, metrics = state["model"], state["opt"], state["batch"], state["protected"]
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, state["vocab"]), batch[:, 1:].reshape(-1))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    metrics["train/loss"].append(loss.detach())
    metrics["train/grad_norm"].append(grad_norm)


def _reset_train(state: dict[str, Any]) -> None:
    state["protected"]["train/loss"].clear()
    state["protected"]["train/grad_norm"].clear()


def micro_reads(rollout_data: dict[str, Any], n_ops: int) -> torch.Tensor:
    x, y = rollout_data["log_probs"][0], rollout_data["ref_log_probs"][1]
    t = x
    for _ in range(n_ops // 5):
        t = x * y
        t = t + y
        t = t - x
        t = t * 0.5
        t = t + 1.0
    return t


def micro_inplace_20(rollout_data: dict[str, Any], n_ops: int) -> torch.Tensor:
    x, y = rollout_data["log_probs"][0], rollout_data["ref_log_probs"][1]
    t = x
    for _ in range(n_ops // 5):
        t = x * y
        t = t + y
        t = t - x
        t = t * 0.5
        t.add_(1.0)     # one op in five writes, a temporary
    return t


def micro_inplace_100(rollout_data: dict[str, Any], n_ops: int) -> torch.Tensor:
    x, y = rollout_data["log_probs"][0], rollout_data["ref_log_probs"][1]
    t = torch.empty_like(x)
    for _ in range(n_ops // 5):
        t.copy_(x)
        t.mul_(y)
        t.add_(y)
        t.sub_(x)
        t.mul_(0.5)     # every op writes, the same temporary
    return t


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _count_tensors(n: int) -> dict[str, Any]:
    """n tensors of 1 KB (256 fp32) in per-sample lists over 6 keys, as a rollout holds them."""
    keys = ["values", "log_probs", "ref_log_probs", "loss_masks", "rewards", "kl"]
    out: dict[str, Any] = {}
    for i, key in enumerate(keys):
        k = n // len(keys) + (1 if i < n % len(keys) else 0)
        out[key] = [torch.randn(256) for _ in range(k)]
    return out


def _fmt_bytes(n: int) -> str:
    return f"{n >> 30} GB" if n >= 1 << 30 else f"{n >> 20} MB"


def workloads(size: str) -> tuple[list[Workload], list[str]]:
    """The workloads of a size (built lazily), and notes on rows left out."""
    cfg = SIZES[size]
    samples, seq, per_prompt = cfg["samples"], cfg["seq"], cfg["per_prompt"]
    n_ops = cfg["micro_ops"]
    loads: list[Workload] = []
    notes: list[str] = []
    n_rollout = 6 * samples + 1  # tensors of make_rollout

    for est, what in (("ppo_gae", "PPO + GAE (per-token loop)"), ("grpo", "GRPO"),
                      ("reinforce_pp", "REINFORCE++ (vectorised)")):
        loads.append(Workload(
            f"adv_{est}", "ratio", f"{what}, {samples} × {seq}",
            build=lambda: {"rollout_data": make_rollout(samples, seq), "protected": None},
            run=lambda st, est=est: compute_advantages_and_returns(st["rollout_data"], est, per_prompt),
            reset=_unplace, tensors=n_rollout))
        if est == "grpo":  # against the row above: the caller's stack must not change a placement's cost
            loads.append(Workload(
                "adv_grpo_deep", "ratio", f"GRPO, {samples} × {seq}, {DEEP_FRAMES} frames deep",
                build=lambda: {"rollout_data": make_rollout(samples, seq), "protected": None, "call": deep_caller()},
                run=lambda st: st["call"](st["rollout_data"], per_prompt),
                reset=_unplace, tensors=n_rollout))
    wide = cfg["wide_samples"]
    loads.append(Workload(
        "adv_wide", "ratio", f"PPO + GAE, wide batch, {wide} × {seq}",
        build=lambda: {"rollout_data": make_rollout(wide, seq), "protected": None},
        run=lambda st: compute_advantages_and_returns(st["rollout_data"], "ppo_gae", per_prompt),
        reset=_unplace, tensors=6 * wide + 1))
    lm = cfg["lm"]
    for fused in (False, True):
        loads.append(Workload(
            f"train_adamw_{'fused' if fused else 'foreach'}", "ratio",
            f"LM step d={lm['d']} L={lm['layers']} {lm['batch']}×{lm['seq']}, AdamW {'fused' if fused else 'foreach'}",
            build=lambda fused=fused: build_train(lm, fused), run=train_step, reset=_reset_train,
            tensors=2 + 2 * lm["logged"]))
    for name, fn, what in (("micro_reads", micro_reads, "reads"),
                           ("micro_inplace_20", micro_inplace_20, "20 % in place"),
                           ("micro_inplace_100", micro_inplace_100, "100 % in place")):
        loads.append(Workload(
            name, "ratio", f"{n_ops:,} ops, {what}",
            build=lambda: {"rollout_data": make_rollout(samples, seq), "protected": None},
            run=lambda st, fn=fn: fn(st["rollout_data"], n_ops), tensors=n_rollout))

    for nbytes, inner in cfg["bytes"]:
        name = f"entry_exit_{_fmt_bytes(nbytes).replace(' ', '')}"
        avail = _mem_available()
        need = 4 * nbytes + (1 << 30)  # tensor, clone, comparison temporaries, headroom
        if nbytes >= 1 << 30 and avail is not None and avail < need:
            notes.append(f"{name} skipped: {avail / 2**30:.1f} GB available, {need / 2**30:.1f} GB wanted")
            continue
        loads.append(Workload(
            name, "entry_exit", f"1 tensor of {_fmt_bytes(nbytes)}",
            build=lambda nbytes=nbytes: {"protected": {"logits": torch.randn(nbytes // 4)}},
            run=lambda st: None, inner=inner, tensors=1, nbytes=nbytes))
    for n, inner in cfg["counts"]:
        loads.append(Workload(
            f"entry_exit_{n}t", "entry_exit", f"{n:,} tensors of 1 KB",
            build=lambda n=n: {"protected": _count_tensors(n)},
            run=lambda st: None, inner=inner, tensors=n, nbytes=n * 1024))
    if size == "ci":
        notes.append("CI size leaves out entry_exit_1GB, entry_exit_15000t and entry_exit_100000t")
    return loads, notes


def select(loads: list[Workload], only: Optional[str]) -> list[Workload]:
    """`--only`: comma-separated names or name prefixes (`micro`, `entry_exit`, `adv_grpo`)."""
    if not only:
        return loads
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    picked = [w for w in loads if any(w.name == p or w.name.startswith(p) for p in wanted)]
    if not picked:
        raise SystemExit(f"--only {only!r} matches no workload; workloads: {', '.join(w.name for w in loads)}")
    return picked


# ---------------------------------------------------------------------------------------
# Measurement


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.writes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            self.writes += 1
        return func(*args, **(kwargs or {}))


def _protected(w: Workload) -> Any:
    st = w.state
    return st["protected"] if st.get("protected") is not None else st["rollout_data"]


def _time_once(w: Workload, factory: Callable[[Any], ContextManager[Any]], hook: Optional[str] = None) -> float:
    """CPU seconds for one timed run: `inner` times (enter, body, exit), with only `hook` installed."""
    from kvguard._engine import choice as _choice

    before = set(_choice._hook_engines)
    _choice.install_only(hook)  # untimed: installing is once per process in a real job
    if set(_choice._hook_engines) != before:
        # Installing re-registers ~1,500 kernels and allocates thousands of objects: the
        # cold dispatcher and their collection are no run's cost. One untimed run warms up.
        # The young generations hold them (a full pass here cost ~0.3 s a switch).
        gc.collect(1)
        try:
            w.run(w.state)
        finally:
            w.reset(w.state)
    obj = _protected(w)
    gc.collect(1)  # untimed: no run pays for the previous one's young garbage; gc stays on during it
    try:
        t0 = time.process_time()
        for _ in range(w.inner):
            with factory(obj):
                w.run(w.state)
        return (time.process_time() - t0) / w.inner
    finally:
        w.reset(w.state)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:110] if text else ''}".rstrip(": ")


def _round_order(i: int) -> list[str]:
    """The contenders' order in round `i`: grouped by the write hook they run with, the groups
    and the members of each rotated from round to round (so no contender always runs first).

    Grouping keeps hook (re)installs to about one per group and workload: each costs a
    re-registration (0.2 s for the Python kernels), a collection and an untimed warm-up run.
    """
    groups = [[c for c in CONTENDER_KEYS if HOOK_OF.get(c) == hook] for hook in (None, "compiled", "kernels")]
    groups = groups[i % len(groups):] + groups[:i % len(groups)]
    return [c for g in groups for c in g[i % len(g):] + g[:i % len(g)]]


def run_suite(loads: list[Workload], rounds: int, repeats: int = 2, max_seconds: float = 5.0,
              progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Times every (workload, contender) pair; returns raw times and the failures.

    times[workload][contender][repeat] is the list of per-round CPU seconds. A contender
    that raises in the warm-up round is not run again on that workload (`skipped`). A peer
    debugging mode (SchemaCheckMode, DebugMode) whose warm-up run takes longer than
    `max_seconds` is timed once, in the first timed round (`slow`: its seconds, and its
    ratio to the reference's run in that round); kvguard and the baselines run every round.
    """
    factories = {key: fac for key, _, fac in CONTENDERS}
    for w in loads:
        progress(f"building {w.name}")
        w.state = w.build()
    times: dict[str, dict[str, list[list[float]]]] = {
        w.name: {c: [[] for _ in range(repeats)] for c in CONTENDER_KEYS} for w in loads}
    skipped: dict[str, dict[str, str]] = {w.name: {} for w in loads}
    slow: dict[str, dict[str, dict[str, float]]] = {w.name: {} for w in loads}
    start = time.perf_counter()
    schedule = [(None, 0)] + [(rep, r) for rep in range(repeats) for r in range(rounds)]
    for i, (rep, r) in enumerate(schedule):
        order = _round_order(i)
        gc.collect()  # a full pass once per round (~0.2 s with torch's ~5e5 objects), untimed
        for w in loads:
            for c in order:
                if c in skipped[w.name] or "seconds" in slow[w.name].get(c, {}):
                    continue
                try:
                    t = _time_once(w, factories[c], HOOK_OF.get(c))
                except Exception as exc:  # a contender that cannot run this workload
                    skipped[w.name][c] = _one_line(exc)
                    progress(f"  {w.name}: {c} cannot run it: {skipped[w.name][c]}")
                    continue
                if rep is None:
                    if t > max_seconds and c in SLOW_PEERS:
                        slow[w.name][c] = {}  # timed once more, in the first timed round
                elif c in slow[w.name]:
                    slow[w.name][c] = {"seconds": t, "round": r}
                else:
                    times[w.name][c][rep].append(t)
        label = "warm-up" if rep is None else f"repeat {rep + 1}, round {r + 1}/{rounds}"
        progress(f"{label} done, {time.perf_counter() - start:.0f} s")
    for w in loads:
        base_key = "clone_compare" if w.kind == "entry_exit" else "unguarded"
        for c, entry in slow[w.name].items():  # against the reference's run in the same round
            base = times[w.name][base_key][0]
            entry["ratio"] = entry["seconds"] / base[0] if base and base[0] else float("nan")
    ops = {}
    from kvguard._engine import choice as _choice

    _choice.install_only(None)  # torch as it ships: a hook's own ops (`kernels` boxes scalars) are not the workload's
    for w in loads:
        if w.kind == "entry_exit":
            ops[w.name] = (0, 0)
            continue
        with _Count() as count:
            w.run(w.state)
        w.reset(w.state)
        ops[w.name] = (count.ops, count.writes)
    return {"times": times, "skipped": skipped, "slow": slow, "ops": ops, "rounds": rounds, "repeats": repeats,
            "max_seconds": max_seconds}


def summarise(loads: list[Workload], raw: dict[str, Any]) -> dict[str, Any]:
    """Per workload and contender: the median of per-round ratios, one per repeat."""
    out: dict[str, Any] = {}
    for w in loads:
        base_key = "clone_compare" if w.kind == "entry_exit" else "unguarded"
        t = raw["times"][w.name]
        row: dict[str, Any] = {"kind": w.kind, "what": w.what, "tensors": w.tensors, "nbytes": w.nbytes,
                               "ops": raw["ops"][w.name], "ratio": {}, "seconds": {}}
        for c in CONTENDER_KEYS:
            if c in raw["skipped"][w.name] or c in raw["slow"][w.name] or (
                    base_key in raw["skipped"][w.name]):
                continue
            row["ratio"][c] = [statistics.median(a / b for a, b in zip(t[c][rep], t[base_key][rep]))
                               for rep in range(raw["repeats"])]
            row["seconds"][c] = [statistics.median(t[c][rep]) for rep in range(raw["repeats"])]
        out[w.name] = row
    return out


# ---------------------------------------------------------------------------------------
# Output


def _num(x: float) -> str:
    if x != x:
        return "nan"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


class _Notes:
    def __init__(self) -> None:
        self.items: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"


def _cell(summary: dict[str, Any], raw: dict[str, Any], name: str, c: str, notes: _Notes,
          value: Callable[[str, int], float], seconds_scale: Optional[float] = None) -> str:
    """One figure per repeat; `seconds_scale` set: the cell shows seconds × scale, else a ratio."""
    if c in raw["skipped"][name]:
        return "skip " + notes.ref(f"{HEADERS[c]} on {name}: {raw['skipped'][name][c]}")
    if c in raw["slow"][name]:
        slow = raw["slow"][name][c]
        shown = slow["ratio"] if seconds_scale is None else slow["seconds"] * seconds_scale
        return f"~{_num(shown)} " + notes.ref(
            f"one run only (repeat 1, round 1): its warm-up run took over --max-seconds "
            f"{raw['max_seconds']:g} s CPU, so it was not repeated")
    if c not in summary[name]["ratio"]:
        return "n/a"
    return " / ".join(_num(value(c, rep)) for rep in range(raw["repeats"]))


def format_tables(loads: list[Workload], raw: dict[str, Any], summary: dict[str, Any]) -> str:
    notes = _Notes()
    reps = " / ".join(f"repeat {i + 1}" for i in range(raw["repeats"]))
    lines: list[str] = []
    ratio_rows = [w for w in loads if w.kind == "ratio"]
    ee_rows = [w for w in loads if w.kind == "entry_exit"]
    others = CONTENDER_KEYS[1:]
    if ratio_rows:
        lines += [f"### Workloads: time / unguarded time (median of per-round ratios, {reps})", ""]
        lines.append("| workload | what | protected | ops (writes) | unguarded ms | "
                     + " | ".join(HEADERS[c] for c in others) + " |")
        lines.append("|---|---|---|---|---|" + "---|" * len(others))
        for w in ratio_rows:
            s = summary[w.name]
            ops, writes = s["ops"]
            ms = _cell(summary, raw, w.name, "unguarded", notes,
                       lambda c, rep: s["seconds"][c][rep] * 1e3, 1e3)
            cells = [_cell(summary, raw, w.name, c, notes, lambda c, rep: s["ratio"][c][rep]) for c in others]
            lines.append(f"| {w.name} | {w.what} | {w.tensors:,} | {ops:,} ({writes:,}) | {ms} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    if ee_rows:
        lines += ["### Guard entry + exit, empty body: time per entry + exit "
                  f"(µs per tensor for the tensor-count rows, ms for the one-tensor rows; median, {reps})", ""]
        lines.append("| workload | what | unit | " + " | ".join(HEADERS[c] for c in CONTENDER_KEYS) + " |")
        lines.append("|---|---|---|" + "---|" * len(CONTENDER_KEYS))
        for w in ee_rows:
            s = summary[w.name]
            per_tensor = w.tensors > 1
            scale = 1e6 / w.tensors if per_tensor else 1e3
            cells = [_cell(summary, raw, w.name, c, notes, lambda c, rep: s["seconds"][c][rep] * scale, scale)
                     for c in CONTENDER_KEYS]
            lines.append(f"| {w.name} | {w.what} | {'µs/tensor' if per_tensor else 'ms'} | " + " | ".join(cells) + " |")
        lines += ["", "### Guard entry + exit: time / clone + compare time "
                  f"(median of per-round ratios, {reps})", ""]
        cols = [c for c in CONTENDER_KEYS if c != "clone_compare"]
        lines.append("| workload | " + " | ".join(HEADERS[c] for c in cols) + " |")
        lines.append("|---|" + "---|" * len(cols))
        for w in ee_rows:
            s = summary[w.name]
            cells = [_cell(summary, raw, w.name, c, notes, lambda c, rep: s["ratio"][c][rep]) for c in cols]
            lines.append(f"| {w.name} | " + " | ".join(cells) + " |")
        lines.append("")
    if notes.items:
        lines += [f"[{i + 1}] {text}" for i, text in enumerate(notes.items)] + [""]
    return "\n".join(lines)


def describe_machine() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = _mem_available()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} CPUs ({cpu}), {mem / 2**30:.0f} GB available, load average {load:.2f}; "
            f"torch {torch.__version__}, Python {platform.python_version()}, torch threads {torch.get_num_threads()}")


def _revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvguard"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return f"{rev}{' + uncommitted changes in kvguard/' if dirty else ''}" if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="realistic")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per repeat (default: 7 realistic, 1 ci)")
    parser.add_argument("--repeats", type=int, default=2, help="independent repeats of all rounds (default 2)")
    parser.add_argument("--only", help="comma-separated workload names or prefixes (micro, entry_exit, adv_grpo, ...)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--max-seconds", type=float, default=5.0,
                        help="SchemaCheckMode or DebugMode whose warm-up run takes longer (CPU s) "
                             "is not repeated (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write raw times and ratios as JSON")
    parser.add_argument("--list", action="store_true", help="list the workloads of --size and exit")
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else SIZES[args.size]["rounds"]
    if rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    loads, left_out = workloads(args.size)
    if args.list:
        print("\n".join(f"{w.name}: {w.what}" for w in loads))
        return 0
    loads = select(loads, args.only)

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    command = "python benchmarks/bench_suite.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    revision = _revision()  # before the run: others may commit while it runs
    raw = run_suite(loads, rounds, args.repeats, args.max_seconds, progress)
    summary = summarise(loads, raw)
    print(f"## kvguard against its peers, size {args.size}\n")
    print(f"`{command.strip()}`; {started:%Y-%m-%d %H:%M} UTC, "
          f"{(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60:.1f} min; "
          f"kvguard {revision}; {describe_machine()}; {rounds} timed rounds × {args.repeats} repeats "
          f"+ 1 warm-up round; process CPU time; gc on.\n")
    print(format_tables(loads, raw, summary))
    for note in left_out:
        if not args.only:
            print(f"Note: {note}.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "size": args.size, "machine": describe_machine(),
                       "started": started.isoformat(), "raw": raw, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
