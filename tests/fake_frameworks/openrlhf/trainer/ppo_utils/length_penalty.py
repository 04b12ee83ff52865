"""Replica of openrlhf/trainer/ppo_utils/length_penalty.py: DAPO's overlong penalty, written in place.

Upstream adds the penalty into `experience.rewards[j]` in place, then re-syncs
`info["reward"]` with a clone so the logged reward shows it: a write made on purpose.
"""

from __future__ import annotations

from typing import Any


def apply_length_penalties(experiences: list, args: Any) -> None:
    buffer_len = getattr(args.reward, "overlong_buffer_len", None)
    if buffer_len is None:
        return
    expected = args.rollout.max_new_tokens - buffer_len
    for experience in experiences:
        for j, length in enumerate(experience.response_length.tolist()):
            exceed = min(length - expected, buffer_len)
            if exceed > 0:
                experience.rewards[j] += -exceed / buffer_len * args.reward.overlong_penalty_factor
    for experience in experiences:
        if "reward" in experience.info:
            experience.info["reward"] = experience.rewards.clone()
