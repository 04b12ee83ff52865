"""Env-var activation: the function the `.pth` / `.start` files and `kvguard run` call.

Imports only `os` until `KVGUARD` says to switch on, so an installed kvguard costs an
unset environment nothing. Idempotent: the `.pth` line, the PEP 829 `.start` file and
the `kvguard run` bootstrap may all call it in one interpreter. Never silently off:
at exit, each way the settings guarded less than they say is one line with its fix.
"""

import os
import sys

from kvguard._state import STATE  # both stdlib only: what the plugin's import of this module costs
from kvguard._text import say

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

    settings = _config.from_env(os.environ)
    if not settings.active or STATE.started:
        return
    STATE.settings, STATE.started = settings, True
    if not settings.targets and not settings.kinds:
        say("kvguard: KVGUARD is on but KVGUARD_TARGETS names no function to guard")
        return
    from kvguard import _ranks
    from kvguard._activate import importhook as _importhook

    _ranks.run_id()  # exported now, so the processes this one starts share it (torchrun's workers)
    if settings.report_dir:
        from kvguard._report.files import output, writer_for

        # Checked now; the header waits for a target, so torchrun's agent writes none.
        writer_for(settings.report_dir, "KVGUARD_REPORT_DIR", output()[1])
    _importhook.install(settings.targets, settings.action, settings.keys, settings.ignore, settings.allow,
                        settings.calls, settings.level)
    if settings.kinds:
        from kvguard._activate.process_kind import activation_of
        from kvguard._kinds import KINDS

        for word in settings.kinds:
            activation_of(KINDS[word]).install(KINDS[word], settings)
    atexit.register(_print_summary)


def _print_summary() -> None:
    from kvguard import _ranks
    from kvguard._report.diagnostics import diagnostics
    from kvguard._report.files import ReportWriter
    from kvguard._report.process import PROCESS

    from kvguard._activate.process_kind import activation_of
    from kvguard._kinds import DATA, KINDS

    settings = STATE.settings
    kinds = [KINDS[word] for word in settings.kinds]
    for kind in kinds:
        activation_of(kind).stop(kind)
    if not STATE.patched and not PROCESS.tally.held_anything() and _is_helper_process():
        return  # torchrun's agent, a DataLoader worker: not where the targets run
    if not STATE.patched and set(settings.kinds) <= {DATA.word} and _data_worker():
        return  # a spawned DataLoader worker: it said its line as it ended, and wrote its summary
    words_only = not settings.targets and not PROCESS.tally.calls  # kinds only (`autograd`, ...): no function
    if not words_only:
        say("\n".join(PROCESS.tally.lines(_ranks.rank_tag(), calls=str(settings.calls))))
    tag = f"kvguard [{_ranks.rank_tag()}]" if _ranks.rank_tag() else "kvguard"
    torch_here = "torch" in sys.modules  # not: a launcher's helper (multiprocessing's resource tracker)
    for kind in kinds if torch_here else ():
        for line in activation_of(kind).exit_lines(kind, tag, PROCESS.tally.counted(kind.word)):
            say(line)
    for line in diagnostics(STATE, PROCESS, any(isinstance(x, ReportWriter) for x in PROCESS.listeners)):
        say(line)


def _data_worker() -> bool:
    """A DataLoader worker whose data guards said their lines as it ended (`kvguard._guard.data`)."""
    guard_data = sys.modules.get("kvguard._guard.data")
    return guard_data is not None and bool(guard_data.in_worker())


def _is_helper_process() -> bool:
    """A launcher's agent (torchrun) or a multiprocessing child: it never loads the targets."""
    if "torch.distributed.elastic.agent.server" in sys.modules:
        return True
    mp = sys.modules.get("multiprocessing")
    try:
        return mp is not None and mp.parent_process() is not None
    except Exception:  # noqa: BLE001
        return False
