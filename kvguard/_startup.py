"""Env-var activation: the function the `.pth` / `.start` files and `kvguard run` call.

Imports only `os` until `KVGUARD` says to switch on, so an installed kvguard costs an
unset environment nothing. Idempotent: the `.pth` line, the PEP 829 `.start` file and
the `kvguard run` bootstrap may all call it in one interpreter.
"""

import os

_activated = False


def activate() -> None:
    """Guard the `KVGUARD_TARGETS` functions in this process if `KVGUARD` is on.

    Never raises: a bad setting or a failure prints one line to stderr and the
    program runs unguarded.
    """
    global _activated
    if _activated or os.environ.get("KVGUARD", "").strip() in ("", "0"):
        return
    _activated = True
    try:
        _start()
    except Exception as exc:  # noqa: BLE001 - a debug switch must not kill the job
        import sys

        sys.stderr.write(f"kvguard: not activated: {exc}\n")


def _start() -> None:
    import atexit
    import sys

    from kvguard import _config
    from kvguard._state import STATE

    settings = _config.from_env(os.environ)
    if not settings.active or STATE.started:
        return
    STATE.settings, STATE.started = settings, True
    if not settings.targets:
        sys.stderr.write("kvguard: KVGUARD is on but KVGUARD_TARGETS names no function to guard\n")
        return
    if settings.report_dir:
        from kvguard._reportfile import JsonlSink

        STATE.listeners.append(JsonlSink(settings.report_dir))
    from kvguard import _importhook

    _importhook.install(settings.targets, settings.action, settings.keys, settings.ignore)
    atexit.register(_print_summary)


def _print_summary() -> None:
    import sys

    from kvguard import _ranks
    from kvguard._state import STATE

    if STATE.patched or STATE.events:  # not in launchers (torchrun) that never load a target
        sys.stderr.write(STATE.summary(_ranks.rank_tag()) + "\n")
