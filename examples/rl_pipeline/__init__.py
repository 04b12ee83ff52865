"""A small RL advantage pipeline in the shape Megatron-based trainers (slime) give it.

`loss.compute_advantages_and_returns(args, rollout_data)` is the function kvguard guards
from the environment in `examples/rl_advantages.py`; it lives in a module (not the main
script) because kvguard patches targets when their module is imported.

- `rollout_data` holds per-sample lists: `log_probs[i]`, `ref_log_probs[i]`, `values[i]`
  (this context-parallel rank's slice), `loss_masks[i]`, `rewards[i]` (floats),
  `response_lengths`, `total_lengths`.
- `ppo_utils`: KL estimators k1 / k2 / k3 / low_var_kl, GAE, GRPO returns, REINFORCE++
  with baseline, masked whitening with an all-reduce.
- `cp_utils`: zigzag context-parallel slicing and gathering.
"""
