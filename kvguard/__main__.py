"""`python -m kvguard`: run a command with kvguard on, render report files, build the write hook, manage the .pth.

    python -m kvguard run [--action warn] [--targets T] [--report-dir D] -- CMD ...
    python -m kvguard report DIR_OR_FILE [--by site|event] [--run ID] [--rank R] [--json]
        exit status 0: every run clean; 1: events; 2: no run found (or only malformed input)
    python -m kvguard presets [NAME ...]
        the presets KVGUARD_TARGETS accepts (slime, verl, ...): what each guards, its source and why
    python -m kvguard intended
        the writes let through with no setting (peft's LoRA merge, trl's reference sync, gradcheck, ...):
        library, versions, functions, what they write and why, and whether each applies here
    python -m kvguard build [--rebuild] [--verbose]
        build (or find) the compiled write hook for the installed torch; exit status 1: it cannot be had
    python -m kvguard engines
        whether each engine (compiled, kernels, mode) can be used here, and which one a guard would use
    python -m kvguard install-pth | uninstall-pth
    python -m kvguard --version
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import TYPE_CHECKING, Optional

import kvguard
from kvguard import _config, _ranks
from kvguard._activate import pth as _pth
from kvguard._errors import ConfigError

if TYPE_CHECKING:
    from kvguard._report.read import Run

_BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_activate", "bootstrap")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvguard", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version_text(),
                        help="print kvguard's version (and torch's, when installed) and exit")
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
    report.add_argument("--width", type=int, default=None, metavar="N",
                        help="the table's width (default: COLUMNS, else the terminal's; in a pipe or a log, "
                             "as wide as the table's contents)")

    presets = sub.add_parser("presets", help="list the presets KVGUARD_TARGETS accepts and what each guards")
    presets.add_argument("names", nargs="*", metavar="NAME", help="only these presets")

    sub.add_parser("intended", help="list the well-known intended writers (peft's LoRA merge, trl's reference "
                                    "model sync, ...) whose writes the weights and autograd guards let through")

    build = sub.add_parser("build", help="build (or find) the compiled write hook for the installed torch, "
                                         "ahead of the first guard")
    build.add_argument("--rebuild", action="store_true",
                       help="build again, even if a build (or a failed one) is cached (as KVGUARD_REBUILD=1)")
    build.add_argument("--verbose", "-v", action="store_true", help="print the compiler's output")

    sub.add_parser("engines", help="whether each engine can be used here, and which one a guard would use "
                                   "(honours KVGUARD_ENGINE)")

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


def _command(opts: argparse.Namespace) -> int:
    if opts.command == "run":
        return _run(opts)
    if opts.command == "report":
        return _report(opts)
    if opts.command == "presets":
        from kvguard._presets import describe

        print(describe(opts.names))
        return 0
    if opts.command == "intended":
        from kvguard._intended import describe as describe_intended

        print(describe_intended())
        return 0
    if opts.command == "build":
        return _build_command(opts)
    if opts.command == "engines":
        return _engines_command()
    if opts.command == "install-pth":
        print(f"kvguard: wrote {_pth.install()}")
        return 0
    removed = _pth.uninstall()
    print(f"kvguard: removed {removed}" if removed else "kvguard: no kvguard.pth to remove")
    return 0


def _version_text() -> str:
    """`kvguard 0.2.0 (torch 2.13.0+cpu, Python 3.11.7)`, without importing torch."""
    import platform

    from kvguard._report.files import _version

    torch = _torch_version() or _version("torch")
    return f"kvguard {kvguard.__version__} ({f'torch {torch}, ' if torch else ''}Python {platform.python_version()})"


def _torch_version() -> Optional[str]:
    """`torch.__version__` as importing torch would say it, read from `torch/version.py`.

    The wheel's metadata can lack the local tag: the index's CUDA builds are `2.13.0` there
    and `2.13.0+cu130` in torch itself.
    """
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, "version.py")
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as fh:
                    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", fh.read(), re.MULTILINE)
                return found[1] if found else None
    except (ImportError, OSError, ValueError):
        return None
    return None


def _discard_stdout() -> None:
    """Python's recipe for a closed pipe: stdout to devnull, so the flush at exit cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run(opts: argparse.Namespace) -> int:
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
    _config.guard_defaults(env)
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


def _report(opts: argparse.Namespace) -> int:
    """Print the runs in the files; 0: every run clean, 1: events, 2: no run found."""
    import json

    from kvguard._report import read as _reportread
    from kvguard._report.render import run_report
    from kvguard._report.files import SCHEMA
    from kvguard._text import plural

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


def _build_command(opts: argparse.Namespace) -> int:
    """Build or find the compiled write hook and check that it loads; 0: it is there, 1: why not (one line)."""
    from kvguard._native import build as _build

    ok, where = _build_result(rebuild=opts.rebuild or _build.rebuild_requested(),
                              verbose=opts.verbose)
    if ok:
        broken = _build.check_loads(where)
        if broken is not None:  # a broken cache entry is a reason, not a traceback
            ok, where = False, f"{where} was built but does not load ({broken}); --rebuild builds it again"
    if not ok:
        print(f"kvguard: the compiled write hook is not available: {_one_line(where)}", file=sys.stderr)
        return 1
    import torch

    print(f"kvguard: the compiled write hook for torch {torch.__version__} is at {where}")
    return 0


def _build_result(*, rebuild: bool, verbose: bool) -> tuple[bool, str]:
    """(True, the `.so`) or (False, why not): a fresh build with `rebuild`, else the cached one if any."""
    from kvguard._native import build as _build

    ok, where = _build.build(verbose=verbose, force=rebuild)
    return ok, where.replace("(KVGUARD_REBUILD=1 retries)", "(--rebuild retries)")


def _engines_command() -> int:
    """A line per engine, available or why not, then the one a guard would use now."""
    import contextlib
    import io

    try:
        from kvguard._engine import choice as _choice
    except ImportError as exc:  # no torch: no engine at all
        print(f"kvguard: no engine can run here: {exc}", file=sys.stderr)
        return 1
    from kvguard._native import build as _build

    width = max(map(len, _choice.ENGINES))
    for name in _choice.ENGINES:
        why = _choice.why_not(name)  # installs the hook: harmless here, and the only true answer
        if why is not None:
            state = f"not available: {_one_line(why)}"
        elif name == "compiled":
            state = f"available ({_build.reason()})"
        else:
            state = "available"
        print(f"{name:<{width}}  {state}")
    # choose() says on stderr what the lines above already said (a fallback, a bad value).
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        chosen = _choice.choose()
    raw = _config.read("KVGUARD_ENGINE")
    if raw.lower() in ("", "auto"):
        why_chosen = "the first available; KVGUARD_ENGINE=compiled|kernels|mode asks for one"
    elif raw.lower() not in _choice.ENGINES:
        why_chosen = f"KVGUARD_ENGINE={raw!r} is not one of auto, {', '.join(_choice.ENGINES)}: the first available"
    elif raw.lower() != chosen:
        why_chosen = f"KVGUARD_ENGINE={raw} asks for {raw.lower()}, which is not available: the next one"
    else:
        why_chosen = f"KVGUARD_ENGINE={raw}"
    print(f"a guard would use: {chosen} ({why_chosen})")
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _nothing_found(opts: argparse.Namespace, runs: list[Run]) -> str:
    if not runs:
        return f"no kvguard report records in {opts.path}"
    named = ", ".join(run.id for run in runs[-5:])
    if opts.run is not None and all(run.id != opts.run for run in runs):
        return f"no run {opts.run!r} in {opts.path}; it holds {named}"
    return f"no records of rank {opts.rank} in {opts.path}" + (f" for run {opts.run!r}" if opts.run else "")


if __name__ == "__main__":
    sys.exit(main())
