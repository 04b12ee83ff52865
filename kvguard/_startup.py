"""Env-var activation: the function the `.pth` / `.start` files and `kvguard run` call.

Imports only `os` until `KVGUARD` says to switch on, so an installed kvguard costs an
unset environment nothing. Idempotent: the `.pth` line, the PEP 829 `.start` file and
the `kvguard run` bootstrap may all call it in one interpreter. Never silently off:
at exit, each way the settings guarded less than they say is one line with its fix.
"""

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvguard._config import Target
    from kvguard._state import State
    from kvguard._tally import TargetStats

_activated = False


def activate() -> None:
    """Guard the `KVGUARD_TARGETS` functions in this process if `KVGUARD` is on.

    Never raises: a bad setting or a failure prints one line to stderr and the
    program runs unguarded.
    """
    global _activated
    if _activated or os.environ.get("KVGUARD", "").strip() in ("", "0") or _is_kvguard_command():
        return
    _activated = True
    try:
        _start()
    except Exception as exc:  # noqa: BLE001 - a debug switch must not kill the job
        from kvguard._render import say

        say(f"kvguard: not activated: {exc}")


def _is_kvguard_command() -> bool:
    """Whether this interpreter runs kvguard's own command line (`python -m kvguard ...`, `kvguard ...`).

    That process is not the job: `kvguard report` or `build` with `KVGUARD` exported must not
    print a summary of its own, nor `kvguard run` a second "not activated" line before the
    job it starts says its own. Read from `sys.orig_argv`, which is set before `.pth` files run.
    """
    argv = list(getattr(sys, "orig_argv", None) or [])[1:]
    while argv:
        arg = argv.pop(0)
        if arg in ("-W", "-X"):
            argv[:1] = []
        elif arg == "-m" or (arg.startswith("-m") and len(arg) > 2):
            module = arg[2:] or (argv[0] if argv else "")
            return module in ("kvguard", "kvguard.__main__")
        elif arg == "-c" or not arg.startswith("-"):  # a command, or the script: kvguard's console script?
            return arg != "-c" and os.path.basename(arg) in ("kvguard", "kvguard.exe")
    return False


def not_activated_hint() -> "str | None":
    """The fix, when `KVGUARD` and `KVGUARD_TARGETS` are set but activation never ran here.

    Activation runs from `kvguard.pth` (installed with kvguard, editable installs
    included) or from `python -m kvguard run`. A source checkout on `PYTHONPATH`, an
    install without the file, or `python -S` has neither.
    """
    if _activated or os.environ.get("KVGUARD", "").strip() in ("", "0"):
        return None
    if not os.environ.get("KVGUARD_TARGETS", "").strip():
        return None
    return ("kvguard: KVGUARD is set but kvguard was not activated in this interpreter (no kvguard.pth "
            "ran), so KVGUARD_TARGETS is not guarded; run 'python -m kvguard install-pth' once in this "
            "environment, or launch with 'python -m kvguard run -- ...'")


def _start() -> None:
    import atexit

    from kvguard import _config
    from kvguard._render import say
    from kvguard._state import STATE

    settings = _config.from_env(os.environ)
    if not settings.active or STATE.started:
        return
    STATE.settings, STATE.started = settings, True
    if not settings.targets:
        say("kvguard: KVGUARD is on but KVGUARD_TARGETS names no function to guard")
        return
    from kvguard import _importhook, _ranks

    _ranks.run_id()  # exported now, so the processes this one starts share it (torchrun's workers)
    if settings.report_dir:
        from kvguard._reportfile import writer_for

        # Checked now; the header waits for a target, so torchrun's agent writes none.
        writer_for(settings.report_dir, "KVGUARD_REPORT_DIR", STATE.output()[1])
    _importhook.install(settings.targets, settings.action, settings.keys, settings.ignore, settings.allow,
                        settings.calls, settings.level)
    atexit.register(_print_summary)


def _print_summary() -> None:
    from kvguard import _ranks
    from kvguard._render import say
    from kvguard._state import STATE

    if not STATE.patched and not STATE.tally.calls and _is_helper_process():
        return  # torchrun's agent, a DataLoader worker: not where the targets run
    say("\n".join(STATE.tally.lines(_ranks.rank_tag(), calls=str(STATE.settings.calls))))
    for line in diagnostics(STATE):
        say(line)


def diagnostics(state: "State") -> list[str]:
    """One `kvguard: ...` line for each way the settings guarded less than they say."""
    from kvguard._presets import diagnostics as preset_lines, is_preset

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
            from kvguard._tally import not_run_reasons, plural

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
    from kvguard._reportfile import ReportWriter

    writes = state.tally.writes
    if settings.action == "record" and writes and not any(isinstance(x, ReportWriter) for x in state.listeners):
        lines.append(f"kvguard: KVGUARD=record kept {writes} event{'s' if writes != 1 else ''} "
                     "in memory only; set KVGUARD_REPORT_DIR=DIR to write them to files, or use "
                     "KVGUARD=warn to print them")
    return lines


def _unguardable_line(target: "Target", stats: "TargetStats") -> str:
    """The exit line for calls whose argument held nothing kvguard walks (said at the first one too)."""
    from kvguard._importhook import WALKED, first_hints

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
    import importlib.util

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


def _is_helper_process() -> bool:
    """A launcher's agent (torchrun) or a multiprocessing child: it never loads the targets."""
    if "torch.distributed.elastic.agent.server" in sys.modules:
        return True
    mp = sys.modules.get("multiprocessing")
    try:
        return mp is not None and mp.parent_process() is not None
    except Exception:  # noqa: BLE001
        return False
