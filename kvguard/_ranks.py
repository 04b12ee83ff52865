"""Which launch and which process of a distributed job this is, for report tags. Stdlib only.

Reads `torch.distributed` only if it is already imported and initialised, else the
`RANK` / `LOCAL_RANK` / `WORLD_SIZE` variables torchrun sets. Integrations add finer
tags (Megatron's tp/pp/dp/cp) through the `kvguard.rank_tags` entry-point group or
`register_tagger`; their failures never break a report. They may also say that guarded
code does not run in this process (`register_not_run_check`).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, Callable, Optional

Tagger = Callable[[], "dict[str, Any]"]
_taggers: list[Tagger] = []
_entry_points_loaded = False


def register_tagger(tagger: Tagger) -> Callable[[], None]:
    """Add a function returning extra tags (`{"tp": 1, "pp": 0}`); returns its undo."""
    _taggers.append(tagger)
    return lambda: _taggers.remove(tagger) if tagger in _taggers else None


NotRunCheck = Callable[[], Optional[str]]
_not_run_checks: list[NotRunCheck] = []


def register_not_run_check(check: NotRunCheck) -> Callable[[], None]:
    """Add a function saying why guarded code does not run in this process, or None; returns its undo.

    The hook for integrations that know where code runs (Megatron: only the last
    pipeline stage computes advantages). A guarded call that did nothing here (no op
    dispatched under its guard, no finding) is then counted as "not run here", with the
    check's reason, instead of as a clean guarded call. Integrations loaded through the
    `kvguard.rank_tags` entry-point group register theirs when imported.
    """
    if check not in _not_run_checks:
        _not_run_checks.append(check)
    return lambda: _not_run_checks.remove(check) if check in _not_run_checks else None


def not_run_reason() -> Optional[str]:
    """Why guarded code does not run in this process (`not the last pipeline stage, ...`), or None.

    Loads the integrations first; a check that fails counts as "no reason", never as an error.
    """
    _load_entry_points()
    for check in list(_not_run_checks):
        try:
            reason = check()
        except Exception:  # noqa: BLE001 - a guess about where code runs must never fail a guard
            continue
        if reason:
            return str(reason)
    return None


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group="kvguard.rank_tags"):
            try:
                _taggers.append(ep.load())
            except Exception as exc:  # noqa: BLE001
                if not _not_installed(exc, ep.module):
                    sys.stderr.write(f"kvguard: rank tags from {ep.value} unavailable: {exc}\n")
    except Exception:  # noqa: BLE001
        pass


def _not_installed(exc: BaseException, module: str) -> bool:
    """Whether loading `module` failed only because it is absent (not an error: say nothing).

    A source checkout on `PYTHONPATH` carries kvguard's metadata, which names the
    `kvguard_megatron` integration, without the package itself. A module that is there
    but fails to import (its own bug, or a dependency it lacks) is a real failure.
    """
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    return bool(missing) and (module == missing or module.startswith(f"{missing}."))


def rank_info() -> dict[str, Any]:
    """`rank`, `local_rank`, `world_size` (None when unknown) plus integration tags."""
    info: dict[str, Any] = {"rank": _env_int("RANK"), "local_rank": _env_int("LOCAL_RANK"),
                            "world_size": _env_int("WORLD_SIZE")}
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            info["rank"], info["world_size"] = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    _load_entry_points()
    for tagger in list(_taggers):
        try:
            info.update(tagger() or {})
        except Exception:  # noqa: BLE001 - tags are decoration; never fail a report
            pass
    return info


def rank_tag(info: Optional[dict[str, Any]] = None) -> str:
    """`rank 3/8 tp=1 pp=0`, or "" for a single process with no rank information."""
    info = rank_info() if info is None else info
    if info.get("rank") is None:
        return ""
    world = info.get("world_size")
    parts = [f"rank {info['rank']}" + (f"/{world}" if world is not None else "")]
    parts += [f"{k}={v}" for k, v in info.items()
              if k not in ("rank", "world_size", "local_rank") and v is not None]
    return " ".join(parts)


def run_id() -> str:
    """The id shared by every process of one launch; every report record carries it.

    torchrun's `TORCHELASTIC_RUN_ID` (its `--rdzv-id`, shared by all nodes) unless it is
    "none"; else `KVGUARD_RUN_ID`, which `kvguard run` sets, and so does the first
    process that activates kvguard, for the processes it starts (torchrun's workers);
    else a new id, exported the same way.
    """
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic != "none":
        return elastic
    own = os.environ.get("KVGUARD_RUN_ID", "").strip()
    if not own:
        own = os.environ["KVGUARD_RUN_ID"] = new_run_id()
    return own


def new_run_id() -> str:
    """`host-pid-YYYYmmdd-HHMMSS`: unique per launching process, readable in a listing."""
    return f"{socket.gethostname()}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}"


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else None
