"""kvguard's Megatron-core integration: rank tags from `parallel_state`.

Installed as the `kvguard_megatron` package and registered in the `kvguard.rank_tags`
entry-point group, so every kvguard report (panels, JSONL files) from a Megatron job
says which tensor-, pipeline-, data- and context-parallel rank it came from:

    kvguard [rank 3/8 tp=1 pp=0 dp=1 cp=0]: ...

It never imports Megatron (an import costs seconds and pulls in much of the stack): it
reads `parallel_state` only if the job already imported it, and says nothing before
`initialize_model_parallel()` or after `destroy_model_parallel()`. Uses only public
kvguard names.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["rank_tags"]

_MODULE = "megatron.core.parallel_state"

# tag -> the parallel_state getter that gives it; these exist in megatron-core 0.16 to 0.19
_GETTERS: dict[str, str] = {
    "tp": "get_tensor_model_parallel_rank",
    "pp": "get_pipeline_model_parallel_rank",
    "dp": "get_data_parallel_rank",
    "cp": "get_context_parallel_rank",
    "ep": "get_expert_model_parallel_rank",
    "vpp": "get_virtual_pipeline_model_parallel_rank",
}


def rank_tags() -> dict[str, Any]:
    """`{"tp": 1, "pp": 0, "dp": 1, "cp": 0, ...}` for this process, or `{}` without Megatron."""
    state = sys.modules.get(_MODULE)
    if state is None:
        return {}
    try:
        if not state.model_parallel_is_initialized():
            return {}
    except Exception:  # noqa: BLE001 - an unfamiliar Megatron: no tags rather than no report
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
