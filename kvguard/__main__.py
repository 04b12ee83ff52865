"""`python -m kvguard`: run a command with kvguard on, render report files, manage the .pth.

    python -m kvguard run [--action warn] [--targets T] [--report-dir D] -- CMD ...
    python -m kvguard report DIR_OR_FILE      exit status 1 when there are events
    python -m kvguard install-pth | uninstall-pth
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any, Optional

import kvguard
from kvguard import _config, _pth
from kvguard._errors import ConfigError

_BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvguard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run CMD with kvguard on in it and in every process it starts")
    run.add_argument("--action", help="raise, warn or record (default: $KVGUARD, else warn)")
    run.add_argument("--targets", help="module:qualname(argname),... (default: $KVGUARD_TARGETS)")
    run.add_argument("--report-dir", help="write kvguard-rank<R>.jsonl here (default: $KVGUARD_REPORT_DIR)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")

    report = sub.add_parser("report", help="render per-rank report files as one table")
    report.add_argument("path", help="a report directory or one kvguard-rank<R>.jsonl file")
    report.add_argument("--width", type=int, default=None)

    sub.add_parser("install-pth", help="activate on KVGUARD in this environment (for editable installs)")
    sub.add_parser("uninstall-pth", help="remove the file install-pth wrote")

    opts = parser.parse_args(argv)
    try:
        status = _command(opts)
        sys.stdout.flush()  # a reader that left early (`| head`) shows up here, not at exit
        return status
    except BrokenPipeError:
        _discard_stdout()
        return 1
    except (ConfigError, FileNotFoundError) as exc:
        print(f"kvguard: {exc}", file=sys.stderr)
        return 2


def _command(opts: Any) -> int:
    if opts.command == "run":
        return _run(opts)
    if opts.command == "report":
        return _report(opts.path, opts.width)
    if opts.command == "install-pth":
        print(f"kvguard: wrote {_pth.install()}")
        return 0
    removed = _pth.uninstall()
    print(f"kvguard: removed {removed}" if removed else "kvguard: no kvguard.pth to remove")
    return 0


def _discard_stdout() -> None:
    """Python's recipe for a closed pipe: stdout to devnull, so the flush at exit cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run(opts: Any) -> int:
    cmd = opts.cmd[1:] if opts.cmd[:1] == ["--"] else opts.cmd
    if not cmd:
        raise ConfigError("kvguard run needs a command after --")
    env = dict(os.environ)
    action = opts.action or env.get("KVGUARD") or "warn"
    env["KVGUARD"] = _config.parse_action(action, "--action" if opts.action else _config.env_source("KVGUARD"))
    if opts.targets:
        env["KVGUARD_TARGETS"] = opts.targets
    # Fail here, before the job starts, naming where the bad value came from.
    _config.parse_targets(env.get("KVGUARD_TARGETS", ""),
                          "--targets" if opts.targets else _config.env_source("KVGUARD_TARGETS"))
    if opts.report_dir:
        env["KVGUARD_REPORT_DIR"] = os.path.abspath(opts.report_dir)
    # Bootstrap first, then the directory kvguard is imported from (a source checkout).
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(kvguard.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_BOOTSTRAP, package_parent, env.get("PYTHONPATH", "")) if p)
    program = shutil.which(cmd[0], path=env.get("PATH")) or cmd[0]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(program, cmd, env)
    return 127  # not reached


def _report(path: str, width: Optional[int]) -> int:
    from kvguard import _reportfile
    from kvguard._render import report_table

    records, problems = _reportfile.read(path)
    for problem in problems:
        print(f"kvguard: {problem}", file=sys.stderr)
    print(report_table(records, width=width))
    return 1 if records else 0


if __name__ == "__main__":
    sys.exit(main())
