"""Rank tags from Megatron's `parallel_state`: `tp=1 pp=0 dp=1 cp=0` on every report."""

from __future__ import annotations

import sys
from typing import Any, Callable

MODULE = "megatron.core.parallel_state"

# tag -> the parallel_state getter that gives it; these exist in megatron-core 0.16 to 0.19
_GETTERS: dict[str, str] = {
    "tp": "get_tensor_model_parallel_rank",
    "pp": "get_pipeline_model_parallel_rank",
    "dp": "get_data_parallel_rank",
    "cp": "get_context_parallel_rank",
    "ep": "get_expert_model_parallel_rank",
    "vpp": "get_virtual_pipeline_model_parallel_rank",
}


def initialized_state() -> Any:
    """`megatron.core.parallel_state` if the job imported it and initialised model parallelism, else None.

    Never imports Megatron; before `initialize_model_parallel()` and after
    `destroy_model_parallel()` (when its getters assert) it is None.
    """
    state = sys.modules.get(MODULE)
    if state is None:
        return None
    try:
        return state if state.model_parallel_is_initialized() else None
    except Exception:  # noqa: BLE001 - an unfamiliar Megatron: as if it were not there
        return None


def rank_tags() -> dict[str, Any]:
    """`{"tp": 1, "pp": 0, "dp": 1, "cp": 0, ...}` for this process, or `{}` without Megatron."""
    state = initialized_state()
    if state is None:
        return {}
    tags: dict[str, Any] = {}
    for tag, name in _GETTERS.items():
        getter: Callable[[], Any] | None = getattr(state, name, None)
        if getter is None:
            continue
        try:
            value = getter()
        except Exception:  # noqa: BLE001 - groups that were not created (e.g. no expert parallelism)
            continue
        if value is not None and not (tag in ("ep", "vpp") and value == 0):
            tags[tag] = value
    return tags
