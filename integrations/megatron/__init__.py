"""kvguard's Megatron-core integration: rank tags, pipeline awareness, the schedule hook.

Installed as the `kvguard_megatron` package and registered in the `kvguard.rank_tags`
entry-point group, so kvguard loads it in every process without a code change:

- **Rank tags**: every report (panels, exit lines, JSONL files) from a Megatron job says
  which tensor-, pipeline-, data- and context-parallel rank it came from:
  `kvguard [rank 3/8 tp=1 pp=0 dp=1 cp=0]: ...`
- **Pipeline awareness**: a guarded call that did nothing on a pipeline stage that is
  not the last (where advantage code returns at once) is counted as "not run here",
  not as clean: `0 guarded calls, 4 calls not run here (not the last pipeline stage:
  pp=0 of 2)`.
- **The schedule hook**: `guard_schedule(get_forward_backward_func(), ...)` keeps the
  loss/metric dicts the schedule returns protected until the trainer has logged them.

It never imports Megatron (an import costs seconds and pulls in much of the stack): it
reads `megatron.core.parallel_state` only if the job already imported it, and says
nothing before `initialize_model_parallel()` or after `destroy_model_parallel()`.
"""

from __future__ import annotations

from kvguard import _ranks

from ._pipeline import not_run_here
from ._schedule import GuardedSchedule, guard_schedule
from ._tags import rank_tags

__all__ = ["GuardedSchedule", "guard_schedule", "not_run_here", "rank_tags"]

_ranks.register_not_run_check(not_run_here)
