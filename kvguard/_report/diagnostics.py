"""The exit diagnostics: one line for each way the settings guarded less than they say.

Said at exit (after the summary, by `_startup`) and written into each report file's
summary record (by `_reportfile.finish_all`); a preset's lines come from `_presets`.
Imports nothing of the job's: a package is searched only when its parent is imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from kvguard._presets import diagnostics as preset_lines, is_preset
from kvguard._state import State
from kvguard._report.tally import TargetStats, not_run_reasons
from kvguard._targets import Target
from kvguard._text import plural

WALKED = "mappings, sequences, dataclasses, SimpleNamespaces and pytree nodes"  # what `_tree` walks
first_hints: dict[str, str] = {}  # target -> the hint said at its first unguardable call, for the exit line


def diagnostics(state: State, in_files: bool) -> list[str]:
    """One `kvguard: ...` line for each way the settings guarded less than they say.

    `in_files`: whether a report writer listens, so that recorded events are not in memory only.
    """
    settings = state.settings
    lines = preset_lines(settings.targets, state)  # a preset's missing and uncalled functions, per preset
    targets = state.tally.targets
    for target in settings.targets:
        stats = targets.get(str(target))
        if str(target) not in state.patched:
            if is_preset(target):
                continue  # said per preset above: missing in this version, or not imported here
            if target.module not in sys.modules:
                lines.append(f"kvguard: target {target.module}:{target.qualname} was never imported "
                             f"({_why_not_imported(target.module)})")
            elif target.module == "__main__":  # said at start-up, with the fix; never counted as clean
                lines.append(f"kvguard: target {target} was not guarded: a function of the main script "
                             "(see the line at start-up)")
            continue  # imported but not patchable: said when it was imported
        assert stats is not None
        skipped = sum(stats.unguardable.values())
        if stats.calls == 0 and stats.unguarded_calls and not skipped:
            lines.append(f"kvguard: target {target}: KVGUARD_CALLS={settings.calls} selected none of its "
                         f"{stats.unguarded_calls} call{'s' if stats.unguarded_calls != 1 else ''}")
        elif stats.calls == 0 and stats.not_run and not skipped:
            lines.append(f"kvguard: target {target} did not run here: "
                         f"{plural(sum(stats.not_run.values()), 'call')} ({not_run_reasons(stats.not_run)}), "
                         "counted as not run, not as clean")
        elif stats.calls == 0 and not skipped:
            if not is_preset(target):  # a preset's: said per preset above, when none of them was called
                lines.append(f"kvguard: target {target} was never called")
        elif stats.calls == 0:
            lines.append(_unguardable_line(target, stats))
        elif stats.protected == 0:
            lines.append(f"kvguard: target {target}: {target.argname} held no tensor in "
                         f"{stats.calls} guarded call{'s' if stats.calls != 1 else ''}")
        if stats.calls and skipped:
            lines.append(_unguardable_line(target, stats))
    seen = set().union(*(s.keys_seen for s in targets.values())) if targets else set()
    missing = [k for k in settings.keys or () if k not in seen]
    if missing and state.tally.calls:
        held = ", ".join(sorted(map(str, seen))[:8]) or "no keys"
        lines.append(f"kvguard: KVGUARD_KEYS names {', '.join(map(repr, missing))}, which no guarded "
                     f"argument ever held (they held {held})")
    writes = state.tally.writes
    if settings.action == "record" and writes and not in_files:
        lines.append(f"kvguard: KVGUARD=record kept {writes} event{'s' if writes != 1 else ''} "
                     "in memory only; set KVGUARD_REPORT_DIR=DIR to write them to files, or use "
                     "KVGUARD=warn to print them")
    return lines


def _unguardable_line(target: Target, stats: TargetStats) -> str:
    """The exit line for calls whose argument held nothing kvguard walks (said at the first one too)."""
    skipped = sum(stats.unguardable.values())
    calls = f"{skipped} call{'s' if skipped != 1 else ''}"
    if stats.calls:
        calls = f"{skipped} of its {skipped + stats.calls} calls"
    kinds = ", ".join(sorted(stats.unguardable))
    hint = first_hints.get(str(target))
    return (f"kvguard: target {target}: {target.argname} was never guarded in {calls}: it held {kinds}, whose "
            f"contents kvguard does not walk (it walks {WALKED})" + (f"; {hint}" if hint else ""))


def _why_not_imported(module: str) -> str:
    """`no module named 'x.y'`, or that the module exists but this process never imported it.

    Imports nothing: a package is searched only when its parent is already imported.
    """
    if module in _main_names():
        return (f"{module}.py ran as the main script, __main__, and kvguard guards modules as they are "
                "imported: import it from a small launcher script")
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            continue
        if i > 1 and ".".join(parts[:i - 1]) not in sys.modules:
            break
        try:
            found = importlib.util.find_spec(name) is not None
        except Exception as exc:  # noqa: BLE001 - e.g. the parent is not a package
            return str(exc)
        if not found:
            return f"no module named {name!r}"
    return "it exists, but this process never imported it"


def _main_names() -> set[str]:
    """What the main script would be called as a module (`python job.py`, `python -m pkg.job`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    names = {os.path.splitext(os.path.basename(argv0))[0]} if argv0 else set()
    name = getattr(spec, "name", None)
    return names | ({name} if isinstance(name, str) and name else set())
