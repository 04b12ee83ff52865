"""The exit diagnostics: one line for each way the settings guarded less than they say.

Said at exit (after the summary, by `kvguard._activate.startup`) and written into each report file's
summary record (by `files.finish_all`); a preset's lines too, from its data in `_presets`.
Imports nothing of the job's: a package is searched only when its parent is imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib import metadata
from typing import Iterable, Optional

from kvguard._presets import PRESETS, Preset, PresetTarget, is_preset, missing_reason
from kvguard._report.process import ProcessReport
from kvguard._report.tally import TargetStats, not_run_reasons
from kvguard._state import State
from kvguard._presets import Target
from kvguard._text import plural

WALKED = "mappings, sequences, dataclasses, SimpleNamespaces and pytree nodes"  # what `kvguard._protect.tree` walks
first_hints: dict[str, str] = {}  # target -> the hint said at its first unguardable call, for the exit line
not_guarded: dict[str, str] = {}  # target -> why its module's hook could not patch it (said at start-up too)


def diagnostics(state: State, process: ProcessReport, in_files: bool) -> list[str]:
    """One `kvguard: ...` line for each way the settings guarded less than they say.

    `state` is what activation set up, `process` what its guards reported; `in_files`: whether
    a report writer listens, so that recorded events are not in memory only.
    """
    settings = state.settings
    lines = _preset_lines(settings.targets, state, process)  # a preset's missing and uncalled functions, per preset
    targets = process.tally.targets
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
            elif str(target) in not_guarded:  # imported but not patchable: said at import, and again last
                lines.append(f"kvguard: target {target} was not guarded: {not_guarded[str(target)]}")
            continue
        assert stats is not None
        skipped = sum(stats.unguardable.values())
        if stats.calls == 0 and stats.unguarded_calls and not skipped:
            lines.append(f"kvguard: target {target}: KVGUARD_CALLS={settings.calls} selected none of its "
                         f"{plural(stats.unguarded_calls, 'call')}")
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
                         f"{plural(stats.calls, 'guarded call')}")
        if stats.calls and skipped:
            lines.append(_unguardable_line(target, stats))
    seen = set().union(*(s.keys_seen for s in targets.values())) if targets else set()
    missing = [k for k in settings.keys or () if k not in seen]
    if missing and process.tally.calls:
        held = ", ".join(sorted(map(str, seen))[:8]) or "no keys"
        lines.append(f"kvguard: KVGUARD_KEYS names {', '.join(map(repr, missing))}, which no guarded "
                     f"argument ever held (they held {held})")
    writes = process.tally.writes
    if settings.action == "record" and writes and not in_files:
        lines.append(f"kvguard: KVGUARD=record kept {plural(writes, 'event')} "
                     "in memory only; set KVGUARD_REPORT_DIR=DIR to write them to files, or use "
                     "KVGUARD=warn to print them")
    return lines


def _unguardable_line(target: Target, stats: TargetStats) -> str:
    """The exit line for calls whose argument held nothing kvguard walks (said at the first one too)."""
    skipped = sum(stats.unguardable.values())
    calls = plural(skipped, 'call')
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
    return _find(module) or "it exists, but this process never imported it"


def _find(module: str) -> Optional[str]:
    """`no module named 'x.y'` (or why the search failed) when `module` cannot exist; None if it may.

    Imports nothing: each package is searched only when its parent is already imported,
    and a module whose parent was never imported may exist (None).
    """
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            continue
        if i > 1 and ".".join(parts[:i - 1]) not in sys.modules:
            return None
        try:
            found = importlib.util.find_spec(name) is not None
        except Exception as exc:  # noqa: BLE001 - e.g. the parent is a module, not a package
            return f"no module named {name!r} ({exc})"
        return None if found else f"no module named {name!r}"
    return None


def _main_names() -> set[str]:
    """What the main script would be called as a module (`python job.py`, `python -m pkg.job`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    names = {os.path.splitext(os.path.basename(argv0))[0]} if argv0 else set()
    name = getattr(spec, "name", None)
    return names | ({name} if isinstance(name, str) and name else set())


def _preset_lines(targets: Iterable[Target], state: State, process: ProcessReport) -> list[str]:
    """The exit lines for the presets in `targets`: what they could not guard in this process.

    Per preset: one line when its framework was never imported here; else one line per
    function missing in the installed version; one line when the process imported none
    of the modules it guards (they run in another process); one line when it guarded
    functions but none of them was called. A function that is present, patched and
    called gets the per-target lines every target gets (`diagnostics`).
    """
    slots: dict[str, dict[str, list[PresetTarget]]] = {}
    for target in targets:
        if isinstance(target, PresetTarget):
            slots.setdefault(target.preset, {}).setdefault(target.slot, []).append(target)
    lines = []
    for name, by_slot in slots.items():
        preset = PRESETS[name]
        label = f"kvguard: preset {preset.name}"
        if preset.package not in sys.modules:
            if name in state.settings.implied_presets:
                continue  # `all` guards each framework the process imports: this one it never did
            lines.append(f"{label}: this process never imported {preset.package}, so none of its "
                         f"{plural(len(by_slot), 'function')} was guarded here")
            continue
        patched: list[PresetTarget] = []
        absent: list[str] = []  # modules that may hold a function, never imported here
        guarded = {label.partition("(")[0] for label in state.patched}  # an explicit target's too
        places = {f.target: [f.target, *(where for where, _ in f.also)] for f in preset.functions}
        for slot, located in by_slot.items():
            patched.extend(t for t in located if str(t) in state.patched)
            if any(place.partition("(")[0] in guarded for place in places[slot]):
                continue
            reasons = [_drift(t) for t in located]
            if all(reasons):
                first, *others = zip(located, reasons)
                lines.append(f"{label}: {first[0]} is not in {_version(preset)} ({first[1]})"
                             + "".join(f", nor is {t} ({r})" for t, r in others) + "; not guarded")
            else:
                absent += [t.module for t, r in zip(located, reasons) if r is None and t.module not in sys.modules]
        if absent and not patched:
            lines.append(f"{label} guarded nothing here: this process imported {preset.package} but not "
                         f"{', '.join(dict.fromkeys(absent))}, where its functions are (they run in another "
                         "process?)")
        stats = process.tally.targets
        if patched and not any(_was_called(stats.get(str(t))) for t in patched):
            names = list(dict.fromkeys(t.qualname for t in patched))
            lines.append(f"{label}: its guarded function {names[0]} was never called" if len(names) == 1 else
                         f"{label}: none of its {len(names)} guarded functions was called ({', '.join(names)})")
    return lines


def _drift(target: PresetTarget) -> Optional[str]:
    """Why `target` is not in the installed version, or None when it may be (or is not imported)."""
    if target.module in sys.modules:
        return missing_reason(target)
    return _find(target.module)


def _version(preset: Preset) -> str:
    """`verl 0.6.0` as the installed framework says it, else `this version of verl`."""
    version = getattr(sys.modules.get(preset.package), "__version__", None)
    if not isinstance(version, str):
        try:
            version = metadata.version(preset.distribution)
        except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout)
            return f"this version of {preset.framework}"
    return f"{preset.framework} {version}"


def _was_called(stats: Optional[TargetStats]) -> bool:
    if stats is None:
        return False
    return bool(stats.calls or stats.unguarded_calls or sum(stats.unguardable.values())
                or sum(getattr(stats, "not_run", {}).values()))
