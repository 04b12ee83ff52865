"""GRPO's advantage step then the message-level penalties, on the replica, as grpo_train runs them.

The estimator returns per-sample advantages expanded over the tokens (stride 0); the
penalties then write flagged one-token spans. Prints the penalised advantages and the
logged reward mean.
"""

import torch

from nemo_rl.algorithms.advantage_estimator import GRPOAdvantageEstimator
from nemo_rl.algorithms.grpo import _apply_message_level_advantage_penalties

rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])  # repeated_batch["total_reward"], logged as "reward"
prompt_ids = torch.tensor([0, 0, 1, 1])
mask = torch.ones(4, 4)
estimator = GRPOAdvantageEstimator({"use_leave_one_out_baseline": False, "normalize_rewards": False}, {})
train_data = {"advantages": estimator.compute_advantage(prompt_ids=prompt_ids, rewards=rewards, mask=mask),
              "token_mask": mask, "total_reward": rewards}


def message(role, n, **flags):
    out = {"role": role, "token_ids": torch.arange(n), **flags}
    if role == "assistant":
        out["generation_logprobs"] = torch.zeros(n)
    return out


message_logs = [
    [message("user", 1), message("assistant", 1, is_invalid_tool_call=True), message("assistant", 2)],
    [message("user", 2), message("assistant", 2)],
    [message("user", 1), message("assistant", 3)],
    [message("user", 3), message("assistant", 1, has_malformed_thinking=True)],
]
_apply_message_level_advantage_penalties(train_data, message_logs, invalid_tool_call_advantage=-5.0,
                                         malformed_thinking_advantage=-7.0)
print("advantages", train_data["advantages"].tolist())
print(f"reward {rewards.mean():.4f}")
