"""RL advantage computation on real megatron-core `parallel_state` (gloo, CPU), with kvguard
switched on from the environment only.

Each step builds a rollout the way a Megatron-based trainer holds it (per-sample lists,
this data-parallel rank's samples, this context-parallel rank's slice of each response),
calls `rl_pipeline.loss.compute_advantages_and_returns(args, rollout_data)` (PPO with GAE,
GRPO, REINFORCE++ with baseline; KL estimators k1, k2, k3, low_var_kl; advantages
whitened with an all-reduce over the data- and context-parallel ranks), then logs the
KL the way trainers do, from `rollout_data["kl"]`.

    export KVGUARD_TARGETS="rl_pipeline.loss:compute_advantages_and_returns(rollout_data)"
    KVGUARD=warn KVGUARD_REPORT_DIR=r torchrun --nproc-per-node 2 examples/rl_advantages.py --cp 2 --bug
    python -m kvguard report r

`--bug` reintroduces the in-place KL shaping (`k *= -kl_coef; k[-1] += reward` on the
tensors of `rollout_data["kl"]`): every advantage is still right, but the logged KL is
not. `--pp 2` puts the computation on the last of two pipeline stages; the first returns
at once, and kvguard counts its calls as "not run here". Runs as one process too
(`python examples/rl_advantages.py`). Exit status 0: nothing here notices the bug
except kvguard (and the `kl(policy)` column, which a real trainer does not log).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import warnings
from argparse import Namespace
from typing import Any

import torch
import torch.distributed as dist

# Importing megatron-core without Transformer Engine warns, as expected on CPU.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from rl_pipeline import loss  # noqa: E402 - the module kvguard guards, imported like a trainer's
from rl_pipeline.cp_utils import slice_with_cp  # noqa: E402
from rl_pipeline.ppo_utils import KL_TYPES, compute_approx_kl, local_masks  # noqa: E402

ESTIMATORS = ("ppo", "grpo", "reinforce_plus_plus_baseline")


def parse_args(argv: list[str] | None = None) -> Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--bug", action="store_true", help="shape the PPO rewards in place on rollout_data['kl']")
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument("--kl-types", default=",".join(KL_TYPES))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples-per-prompt", type=int, default=2)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    opts.estimators = [e for e in opts.estimators.split(",") if e]
    opts.kl_types = [k for k in opts.kl_types.split(",") if k]
    return opts


def init_parallel(cp: int, pp: int) -> Any:
    """gloo process group (torchrun's variables, or one local process), then Megatron's groups."""
    if "RANK" not in os.environ:  # plain `python rl_advantages.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, context_parallel_size=cp)
    return parallel_state


def make_rollout(opts: Namespace, estimator: str, step: int, mpu: Any) -> dict[str, Any]:
    """This rank's share of one rollout, as the trainer receives it from the rollout side.

    Every rank draws the same global batch, post-processes the rewards per estimator
    (GRPO: normalised within each prompt's group; REINFORCE++: minus the group mean),
    keeps its data-parallel share and cuts each response to its context-parallel slice.
    Only the last pipeline stage has log-probs and values (it holds the logits).
    """
    g = torch.Generator().manual_seed(opts.seed * 1000 + step)
    n = opts.prompts * opts.samples_per_prompt
    prompt_lengths = torch.randint(6, 11, (n,), generator=g).tolist()
    response_lengths = torch.randint(20, 31, (n,), generator=g).tolist()
    log_probs = [-(torch.rand(r, generator=g) * 1.5 + 0.05) for r in response_lengths]
    ref_log_probs = [lp + 0.1 * torch.randn(lp.shape, generator=g) for lp in log_probs]
    values = [0.1 * torch.randn(r, generator=g) for r in response_lengths]
    raw = torch.randint(1, 11, (n,), generator=g) / 10  # a graded score in (0, 1]
    groups = raw.view(opts.prompts, opts.samples_per_prompt)
    if estimator == "grpo":
        rewards = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).flatten()
    elif estimator == "reinforce_plus_plus_baseline":
        rewards = (groups - groups.mean(1, keepdim=True)).flatten()
    else:
        rewards = raw

    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    mine = list(range(n))[dp_rank * n // dp_size:(dp_rank + 1) * n // dp_size]
    totals = [prompt_lengths[i] + response_lengths[i] for i in mine]
    responses = [response_lengths[i] for i in mine]
    rollout_data: dict[str, Any] = {
        "tokens": [torch.randint(0, 32000, (t,), generator=g) for t in totals],
        "rewards": [float(rewards[i]) for i in mine],
        "loss_masks": [torch.ones(r) for r in responses],
        "response_lengths": responses,
        "total_lengths": totals,
    }
    if mpu.is_pipeline_last_stage():
        for key, full in (("log_probs", log_probs), ("ref_log_probs", ref_log_probs), ("values", values)):
            rollout_data[key] = [slice_with_cp(full[i], t, r) for i, t, r in zip(mine, totals, responses)]
    return rollout_data


def logged_metrics(kl_type: str, rollout_data: dict[str, Any], mpu: Any) -> tuple[float, ...]:
    """What the trainer logs after the step: the KL from `rollout_data["kl"]`, and the KL
    recomputed from the log-probs (the truth, for this demo), masked means over every
    data- and context-parallel rank; the whitened advantages' std and sum of magnitudes
    (the same for any data-, context- or pipeline-parallel layout)."""
    masks = torch.cat(local_masks(rollout_data["loss_masks"], rollout_data["total_lengths"],
                                  rollout_data["response_lengths"]))
    policy_kl = [compute_approx_kl(lp, ref, kl_type)
                 for lp, ref in zip(rollout_data["log_probs"], rollout_data["ref_log_probs"])]
    adv = torch.cat(rollout_data["advantages"])
    sums = torch.stack([(torch.cat(rollout_data["kl"]) * masks).sum(), (torch.cat(policy_kl) * masks).sum(),
                        masks.sum(), adv.sum(), adv.square().sum(), torch.tensor(float(adv.numel())),
                        adv.abs().sum()])
    dist.all_reduce(sums, group=mpu.get_data_parallel_group(with_context_parallel=True))
    logged, policy, count, adv_sum, adv_sq, adv_n, adv_abs = sums.tolist()
    mean = adv_sum / adv_n
    return logged / count, policy / count, max(adv_sq / adv_n - mean * mean, 0.0) ** 0.5, adv_abs


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    mpu = init_parallel(opts.cp, opts.pp)
    reporter = (mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0
                and mpu.get_data_parallel_rank(with_context_parallel=True) == 0)
    if reporter:
        print(f"world {dist.get_world_size()}: tp={mpu.get_tensor_model_parallel_world_size()} "
              f"pp={mpu.get_pipeline_model_parallel_world_size()} dp={mpu.get_data_parallel_world_size()} "
              f"cp={mpu.get_context_parallel_world_size()}{'  (--bug)' if opts.bug else ''}", flush=True)
    step, corrupted = 0, 0
    for estimator in opts.estimators:
        for kl_type in opts.kl_types:
            step += 1
            args = Namespace(advantage_estimator=estimator, kl_type=kl_type, kl_coef=opts.kl_coef, gamma=1.0,
                             lambd=0.95, normalize_advantages=True, bug=opts.bug)
            rollout_data = make_rollout(opts, estimator, step, mpu)
            loss.compute_advantages_and_returns(args, rollout_data)
            if not mpu.is_pipeline_last_stage():
                continue  # logging happens where the advantages are
            logged, policy, adv_std, adv_abs = logged_metrics(kl_type, rollout_data, mpu)
            bad = abs(logged - policy) > 1e-5 * max(1.0, abs(policy))
            corrupted += bad
            if reporter:
                print(f"step {step:2d} {estimator:<28} {kl_type:<10} kl(logged) {logged:+.5f}  "
                      f"kl(policy) {policy:+.5f}  adv std {adv_std:.3f} |sum| {adv_abs:.2f}"
                      f"{'   <- logged KL is not the policy KL' if bad else ''}", flush=True)
    if reporter:
        print(f"logged KL differs from the policy KL in {corrupted} of {step} steps" if corrupted
              else f"logged KL matches the policy KL in all {step} steps", flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
