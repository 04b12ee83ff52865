"""`python -m kvguard`: run a command with kvguard on, render report files, manage the .pth.

    python -m kvguard run [--action warn] [--targets T] [--report-dir D] -- CMD ...
    python -m kvguard report DIR_OR_FILE [--by site|event] [--run ID] [--rank R] [--json]
        exit status 0: every run clean; 1: events; 2: no run found (or only malformed input)
    python -m kvguard presets [NAME ...]
        the presets KVGUARD_TARGETS accepts (slime, verl, ...): what each guards, its source and why
    python -m kvguard install-pth | uninstall-pth
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any, Optional

import kvguard
from kvguard import _config, _pth, _ranks
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

    report = sub.add_parser("report", help="one table per run across ranks and calls: a row per site")
    report.add_argument("path", help="a report directory or one kvguard-rank<R>.jsonl file")
    report.add_argument("--by", choices=("site", "event"), default="site",
                        help="a row per site (code line and op; the default) or per event in the files")
    report.add_argument("--run", metavar="ID", help="only this run id")
    report.add_argument("--rank", type=int, metavar="R", help="only the processes of this rank")
    report.add_argument("--json", action="store_true", help="print the runs as JSON")
    report.add_argument("--width", type=int, default=None)

    presets = sub.add_parser("presets", help="list the presets KVGUARD_TARGETS accepts and what each guards")
    presets.add_argument("names", nargs="*", metavar="NAME", help="only these presets")

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
        return _report(opts)
    if opts.command == "presets":
        from kvguard._presets import describe

        print(describe(opts.names))
        return 0
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
    env.setdefault("KVGUARD_RUN_ID", _ranks.new_run_id())  # one run id for every process of the command
    # Bootstrap first, then the directory kvguard is imported from (a source checkout).
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(kvguard.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_BOOTSTRAP, package_parent, env.get("PYTHONPATH", "")) if p)
    program = shutil.which(cmd[0], path=env.get("PATH")) or cmd[0]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(program, cmd, env)
    return 127  # not reached


def _report(opts: Any) -> int:
    """Print the runs in the files; 0: every run clean, 1: events, 2: no run found."""
    import json

    from kvguard import _reportread
    from kvguard._render import run_report
    from kvguard._reportfile import SCHEMA
    from kvguard._tally import plural

    runs, skipped = _reportread.load(opts.path)
    for bad in skipped:
        print(f"kvguard: skipped {plural(bad.count, 'malformed line')} in {bad.file} (first, {bad.first})",
              file=sys.stderr)
    selected = _reportread.select(runs, opts.run, opts.rank)
    described = [_reportread.describe(run, opts.by) for run in selected]
    if opts.json:
        print(json.dumps({"schema": SCHEMA, "runs": described, "skipped": [vars(bad) for bad in skipped]}, indent=1))
    elif described:
        print("\n\n".join(run_report(run, width=opts.width) for run in described))
    if not selected:
        print(f"kvguard: {_nothing_found(opts, runs)}", file=sys.stderr)
        return 2
    statuses = {run["status"] for run in described}
    return 1 if "events" in statuses else 2 if "unproven" in statuses else 0


def _nothing_found(opts: Any, runs: list[Any]) -> str:
    if not runs:
        return f"no kvguard report records in {opts.path}"
    named = ", ".join(run.id for run in runs[-5:])
    if opts.run is not None and all(run.id != opts.run for run in runs):
        return f"no run {opts.run!r} in {opts.path}; it holds {named}"
    return f"no records of rank {opts.rank} in {opts.path}" + (f" for run {opts.run!r}" if opts.run else "")


if __name__ == "__main__":
    sys.exit(main())
