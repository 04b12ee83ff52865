"""Pipeline awareness: on a stage that is not the last, advantage code returns at once.

RL trainers on Megatron compute advantages only where the logits are, the last pipeline
stage (slime: `if not mpu.is_pipeline_last_stage(): return`). A guarded call there that
did nothing is "not run here", not a clean call: kvguard asks `not_run_here()` (registered
through `kvguard._ranks.register_not_run_check` when this package is imported) only for
a call that left no trace (no op under its guard, no finding), and counts it apart in
the exit line and the summary record.
"""

from __future__ import annotations

from typing import Optional

from ._tags import initialized_state


def not_run_here() -> Optional[str]:
    """`not the last pipeline stage: pp=0 of 2` on a stage that is not the last, else None.

    None too without Megatron, before `initialize_model_parallel()` and after
    `destroy_model_parallel()`, or when `parallel_state` does not answer.
    """
    state = initialized_state()
    if state is None:
        return None
    try:
        if state.is_pipeline_last_stage():
            return None
        stage = state.get_pipeline_model_parallel_rank()
        stages = state.get_pipeline_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - no answer is "it may have run", never an error
        return None
    return f"not the last pipeline stage: pp={stage} of {stages}"
