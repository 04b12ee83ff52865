"""`python -m kvguard`, end to end: real subprocesses in a plain venv, real pipes.

The venv has no pip and no sitecustomize of its own; kvguard comes from this checkout
through PYTHONPATH (the source-checkout route of `kvguard run`), torch, wrapt and rich
from the test environment through a path file, so nothing is downloaded or built.
Where a test checks stderr it checks all of it: anything unexpected there fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

import kvguard
import kvguard.__main__ as cli
from kvguard._report.events import MutationEvent
from kvguard._report.files import ReportWriter

ROOT = Path(__file__).resolve().parent.parent
# The one line kvguard prints in a process that made one clean guarded call.
CLEAN_SUMMARY = re.compile(r"kvguard: cleanjob:step\(batch\): 1 guarded call, 1 tensor protected, no in-place writes\n")
CLEAN_JOB = "def step(batch):\n    return sorted(batch)\n"
DIRTY_JOB = "def step(batch):\n    batch['x'].add_(1)\n"


def _venv_with_test_deps(home: Path) -> tuple[Path, Path]:
    """A venv at `home` (no kvguard installed) that sees this run's packages: its python, its site dir."""
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "00-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


@pytest.fixture(scope="session")
def plain_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("plain-venv")
    python, site = _venv_with_test_deps(home)
    # That path also holds kvguard's own metadata, whose rank-tag entry point names
    # kvguard_megatron: make it importable as the editable install does.
    (site / "kvguard_megatron").symlink_to(ROOT / "integrations" / "megatron")
    # Its processes use the default cache (`run` passes no KVGUARD_CACHE_DIR): the compiled hook is
    # built there first, or the first test to start a guard prints the build's two lines (a fresh
    # torch, Python or hook source), whichever test that is.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PYTHON"))}
    subprocess.run([str(python), "-m", "kvguard", "build"], env={**env, "PYTHONPATH": str(ROOT)}, cwd=home,
                   capture_output=True, timeout=900)  # a build: 20-150 s on a busy 2-core box
    return python


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A directory holding the modules a job imports: `cleanjob` and `dirtyjob`."""
    (tmp_path / "cleanjob.py").write_text(CLEAN_JOB)
    (tmp_path / "dirtyjob.py").write_text(DIRTY_JOB)
    return tmp_path


def run(python: Path, *args: str, cwd: Path, env: dict[str, str] | None = None,
        pythonpath: tuple[Path, ...] = (ROOT,)) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with no kvguard, rank or Python settings inherited from the test run."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("KVGUARD", "PYTHON")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    return subprocess.run([str(python), *args], env={**base, **(env or {})}, cwd=cwd,
                          capture_output=True, text=True, timeout=180)


def kvguard_run(python: Path, *options: str, code: str, cwd: Path, env: dict[str, str] | None = None,
                pythonpath: tuple[Path, ...] = (ROOT,)) -> subprocess.CompletedProcess[str]:
    """`python -m kvguard run OPTIONS -- python -c CODE`, the child being the same python."""
    return run(python, "-m", "kvguard", "run", *options, "--", str(python), "-c", code,
               cwd=cwd, env=env, pythonpath=pythonpath)


# 1. The bootstrap sitecustomize: nothing on stderr but kvguard's own line, and chaining.

def test_run_prints_nothing_but_the_summary(plain_python: Path, job: Path) -> None:
    result = kvguard_run(plain_python, "--action", "warn", cwd=job,
                         code="import cleanjob, torch; print(cleanjob.step({'b': torch.ones(1), 'a': 2}))",
                         env={"KVGUARD_TARGETS": "cleanjob:step(batch)"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "['a', 'b']\n"
    assert CLEAN_SUMMARY.fullmatch(result.stderr), result.stderr


def test_run_chains_to_the_next_sitecustomize(plain_python: Path, job: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The job sees the sitecustomize it would see without kvguard, and what it put on sys.path."""
    other = tmp_path_factory.mktemp("other-site")
    (other / "sitecustomize.py").write_text("import sys\nprint('chained sitecustomize ran')\n"
                                            "sys.path.append('/added/by/chained')\n")
    code = ("import sys, sitecustomize, cleanjob, torch; cleanjob.step({'t': torch.ones(1)}); "
            "print(sitecustomize.__file__); print('/added/by/chained' in sys.path)")
    expected = f"chained sitecustomize ran\n{other / 'sitecustomize.py'}\nTrue\n"
    plain = run(plain_python, "-c", code, cwd=job, pythonpath=(ROOT, other))
    assert (plain.stdout, plain.stderr) == (expected, "")
    result = kvguard_run(plain_python, "--targets", "cleanjob:step(batch)", code=code, cwd=job,
                         pythonpath=(ROOT, other))
    assert result.stdout == "chained sitecustomize ran\n" + expected  # `python -m kvguard` ran it too
    assert CLEAN_SUMMARY.fullmatch(result.stderr), result.stderr


def test_a_broken_next_sitecustomize_fails_as_without_kvguard(plain_python: Path, job: Path,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    other = tmp_path_factory.mktemp("broken-site")
    (other / "sitecustomize.py").write_text("raise RuntimeError('boom')\n")
    code = "import cleanjob, torch; cleanjob.step({'t': torch.ones(1)})"
    plain = run(plain_python, "-c", code, cwd=job, pythonpath=(ROOT, other))
    assert plain.stderr == "Error in sitecustomize; set PYTHONVERBOSE for traceback:\nRuntimeError: boom\n"
    result = kvguard_run(plain_python, "--targets", "cleanjob:step(batch)", code=code, cwd=job,
                         pythonpath=(ROOT, other))
    assert result.returncode == 0
    assert result.stderr.startswith(plain.stderr * 2)  # `python -m kvguard`, then the job: each as Python says
    assert CLEAN_SUMMARY.fullmatch(result.stderr[2 * len(plain.stderr):]), result.stderr


# 2. A bad --targets is named as --targets; a bad $KVGUARD_TARGETS as the variable.

@pytest.fixture
def no_exec(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    """Run `main` in this process: the environments it would have exec'd the job with."""
    for name in [k for k in os.environ if k.startswith("KVGUARD")]:
        monkeypatch.delenv(name)
    launched: list[dict[str, str]] = []

    def execve(program: str, cmd: list[str], env: dict[str, str]) -> None:
        launched.append(env)

    monkeypatch.setattr(os, "execve", execve)  # the one `kvguard run` calls
    return launched


@pytest.mark.parametrize("option, environ, source", [
    (["--targets", "bad"], {}, "--targets"),
    (["--targets", "bad"], {"KVGUARD_TARGETS": "m:f(x)"}, "--targets"),
    ([], {"KVGUARD_TARGETS": "bad"}, "the KVGUARD_TARGETS environment variable"),
])
def test_bad_targets_name_their_source(no_exec: list[dict[str, str]], monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str], option: list[str],
                                       environ: dict[str, str], source: str) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["run", *option, "--", "python", "x.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and no_exec == []
    assert re.fullmatch(rf"kvguard: invalid target 'bad' in {re.escape(source)}; [^\n]*\n", err), err


def test_good_targets_option_wins_over_a_bad_variable(no_exec: list[dict[str, str]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_TARGETS", "bad")
    cli.main(["run", "--targets", "m:f(x)", "--", "python", "x.py"])
    assert [env["KVGUARD_TARGETS"] for env in no_exec] == ["m:f(x)"]


def test_bad_targets_exit_2_with_one_line(plain_python: Path, tmp_path: Path) -> None:
    result = run(plain_python, "-m", "kvguard", "run", "--targets", "bad", "--", "python", "x.py", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert re.fullmatch(r"kvguard: invalid target 'bad' in --targets; [^\n]*\n", result.stderr), result.stderr


# 3. `report | head -1`: a reader that leaves early is not an error worth a traceback.

def _event(i: int) -> MutationEvent:
    return MutationEvent(
        path=f"rollout_data['kl'][{i}]", op="aten.mul_.Tensor", kind="write", blocked=False,
        filename="/job/trainer_loss.py", lineno=i, code="k *= 0.1", function="compute",
        placed_at="trainer_loss.py:8", tensor="f32[16] cpu", before="[0.1, 0.2]", after="[0.01, 0.02]",
        diff="16/16 elements changed")


class _Guard:
    target, name, action, call = "trainer_loss:compute(rollout_data)", "rollout_data", "warn", 1

    def __init__(self, report_dir: str) -> None:
        self.report_dir = report_dir


@pytest.fixture
def many_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A report directory whose table is far larger than a pipe's buffer (1,500 sites, no summary)."""
    monkeypatch.setenv("KVGUARD_RUN_ID", "many")
    monkeypatch.delenv("RANK", raising=False)
    writer = ReportWriter(str(tmp_path), limit=1500)
    writer.begin()
    for i in range(1500):
        writer(_event(i), _Guard(str(tmp_path)))
    return tmp_path


MANY_HEADLINE = "kvguard: run many (1 process): 1 guarded call, 1,500 writes at 1,500 sites"


def test_report_into_a_closed_pipe_is_quiet(many_events: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvguard", "report", str(many_events), "--width", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(MANY_HEADLINE)
    proc.stdout.close()  # what `head -1` does
    with proc.stderr:
        err = proc.stderr.read()
    assert proc.wait(timeout=180) == 1
    assert err == ""


def test_report_through_head(many_events: Path) -> None:
    result = subprocess.run(f"{sys.executable} -m kvguard report {many_events} | head -1", shell=True,
                            capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.stdout.startswith(MANY_HEADLINE)
    assert result.stderr == ""


# 4. Action spellings are case-insensitive from the command line too.

@pytest.mark.parametrize("action, rc, stderr_has", [
    ("WARN", 0, "batch['x'] was modified in place by aten.add_.Tensor"),
    ("Raise", 1, "kvguard.MutationError: batch['x'] would be modified in place by aten.add_.Tensor"),
])
def test_action_spelling_is_case_insensitive(plain_python: Path, job: Path, action: str, rc: int,
                                             stderr_has: str) -> None:
    code = "import torch, dirtyjob; rollout = {'x': torch.zeros(3)}; dirtyjob.step(rollout); print('done')"
    result = kvguard_run(plain_python, "--action", action, "--targets", "dirtyjob:step(batch)", code=code, cwd=job)
    assert result.returncode == rc, result.stderr
    assert stderr_has in result.stderr
    assert ("done" in result.stdout) == (rc == 0)


def test_action_option_sets_the_canonical_spelling(no_exec: list[dict[str, str]]) -> None:
    cli.main(["run", "--action", "RECORD", "--", "python", "x.py"])
    assert [env["KVGUARD"] for env in no_exec] == ["record"]


# 5. `build` and `engines`: the compiled write hook ahead of time, and which engine would run.

BUILD_LINE = re.compile(r"kvguard: building the compiled write hook for torch \S+ \(once per torch version; "
                        r"compiling takes about 45 s, 40 s of CPU\) into \S+\n")
BUILT_LINE = re.compile(r"kvguard: built the compiled write hook in \d+\.\d s \(\d+\.\d s of CPU\)\n")
NOT_AVAILABLE = "kvguard: the compiled write hook is not available: "


@pytest.fixture
def compiled_cache() -> Path:
    """The cache directory holding this process's compiled write hook (built now if need be)."""
    from kvguard._native import build as _build

    if _build.load() is None:
        if os.environ.get("CI"):
            pytest.fail(f"the compiled write hook did not build under CI: {_build.reason()}")
        pytest.skip(f"the compiled write hook is not available here: {_build.reason()}")
    return _build.cache_root()


def no_compiler(tmp_path: Path) -> dict[str, str]:
    """No C++ compiler: CXX names a missing one, PATH is an empty directory; an empty cache."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    return {"CXX": "/nonexistent/c++", "PATH": str(empty), "KVGUARD_CACHE_DIR": str(tmp_path / "cache")}


def fake_compiler(tmp_path: Path, script: str) -> str:
    path = tmp_path / "fake-c++"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


def test_build_finds_the_cached_hook(plain_python: Path, tmp_path: Path, compiled_cache: Path) -> None:
    import torch

    from kvguard._native import build as _build

    result = run(plain_python, "-m", "kvguard", "build", cwd=tmp_path, env={"KVGUARD_CACHE_DIR": str(compiled_cache)})
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    match = re.fullmatch(r"kvguard: the compiled write hook for torch (\S+) is at (\S+)\n", result.stdout)
    assert match is not None, result.stdout
    assert match[1] == torch.__version__ and Path(match[2]).parent == _build.build_dir()
    assert Path(match[2]).is_file()


@pytest.mark.parametrize("options", [(), ("--rebuild",)], ids=["build", "rebuild"])
def test_build_without_a_compiler_is_one_line_and_exit_1(plain_python: Path, tmp_path: Path,
                                                         options: tuple[str, ...]) -> None:
    env = no_compiler(tmp_path)
    result = run(plain_python, "-m", "kvguard", "build", *options, cwd=tmp_path, env=env)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (NOT_AVAILABLE + "no C++ compiler (CXX=/nonexistent/c++ was not found; "
                             "set CXX to a C++ compiler)\n"), result.stderr
    assert not (tmp_path / "cache").exists()  # a missing compiler is not remembered
    result = run(plain_python, "-m", "kvguard", "build", *options, cwd=tmp_path, env={**env, "CXX": ""})
    assert (result.returncode, result.stderr) == (1, NOT_AVAILABLE + "no C++ compiler (set CXX)\n")


def test_a_failed_build_is_remembered_until_rebuild(plain_python: Path, tmp_path: Path) -> None:
    env = {"CXX": fake_compiler(tmp_path, "echo 'error: simulated failure' >&2\nexit 1\n"),
           "KVGUARD_CACHE_DIR": str(tmp_path / "cache")}
    first = run(plain_python, "-m", "kvguard", "build", cwd=tmp_path, env=env)
    assert (first.returncode, first.stdout) == (1, "")
    building, reason = first.stderr.splitlines(keepends=True)
    assert BUILD_LINE.fullmatch(building), first.stderr
    # One line that names the compiler's first error, then where its whole output is.
    assert re.fullmatch(re.escape(NOT_AVAILABLE) + r"the compiler failed: error: simulated failure; "
                        r"the whole output is in (\S+/build\.log)\n", reason), reason
    [log] = (tmp_path / "cache").rglob("build.log")
    assert "simulated failure" in log.read_text() and str(log) in reason
    # Not retried on its own: the same reason, no build, and how to retry.
    again = run(plain_python, "-m", "kvguard", "build", cwd=tmp_path, env=env)
    assert (again.returncode, again.stderr) == (1, reason.rstrip("\n") + " (--rebuild retries)\n")
    for retry in (("--rebuild",), ()):  # --rebuild, or KVGUARD_REBUILD=1 as for a guard
        result = run(plain_python, "-m", "kvguard", "build", *retry, cwd=tmp_path,
                     env={**env, **({} if retry else {"KVGUARD_REBUILD": "1"})})
        assert result.returncode == 1 and result.stderr.count("\n") == 2, result.stderr
        assert BUILD_LINE.match(result.stderr) and result.stderr.endswith(reason), result.stderr


def test_a_built_hook_that_does_not_load_fails_the_build(plain_python: Path, tmp_path: Path) -> None:
    junk = fake_compiler(tmp_path, 'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                                   'echo "not a shared object" > "$out"\n')
    result = run(plain_python, "-m", "kvguard", "build", cwd=tmp_path,
                 env={"CXX": junk, "KVGUARD_CACHE_DIR": str(tmp_path / "cache")})
    assert (result.returncode, result.stdout) == (1, "")
    building, built, reason = result.stderr.splitlines(keepends=True)
    assert BUILD_LINE.fullmatch(building) and BUILT_LINE.fullmatch(built), result.stderr  # the compiler's part is done
    assert reason.startswith(NOT_AVAILABLE) and "was built but does not load (ImportError: " in reason
    assert reason.endswith("; --rebuild builds it again\n")


ENGINE_LINE = re.compile(r"(compiled|kernels|mode) +(available|available \(loaded from \S+\)|not available: .+)")


def engines(python: Path, cwd: Path, env: dict[str, str]) -> tuple[dict[str, str], str]:
    """`python -m kvguard engines`: each engine's state, and the last line."""
    result = run(python, "-m", "kvguard", "engines", cwd=cwd, env=env)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    *rows, last = result.stdout.splitlines()
    matches = [ENGINE_LINE.fullmatch(row) for row in rows]
    assert all(matches) and [m[1] for m in matches if m] == ["compiled", "kernels", "mode"], result.stdout
    return {m[1]: m[2] for m in matches if m}, last


@pytest.mark.parametrize("requested, chosen, why", [
    (None, "compiled", "the first available; KVGUARD_ENGINE=compiled|kernels|mode asks for one"),
    ("Kernels", "kernels", "KVGUARD_ENGINE=Kernels"),
    ("mode", "mode", "KVGUARD_ENGINE=mode"),
    ("bogus", "compiled", "KVGUARD_ENGINE='bogus' is not one of auto, compiled, kernels, mode: the first available"),
])
def test_engines_says_what_is_available_and_what_a_guard_would_use(
        plain_python: Path, tmp_path: Path, compiled_cache: Path, requested: str | None, chosen: str,
        why: str) -> None:
    env = {"KVGUARD_CACHE_DIR": str(compiled_cache), **({"KVGUARD_ENGINE": requested} if requested else {})}
    states, last = engines(plain_python, tmp_path, env)
    assert states["compiled"].startswith("available (loaded from " + str(compiled_cache))
    assert states["kernels"] == states["mode"] == "available"
    assert last == f"a guard would use: {chosen} ({why})"


@pytest.mark.parametrize("requested, why", [
    (None, "the first available; KVGUARD_ENGINE=compiled|kernels|mode asks for one"),
    ("compiled", "KVGUARD_ENGINE=compiled asks for compiled, which is not available: the next one"),
])
def test_engines_without_a_compiler(plain_python: Path, tmp_path: Path, requested: str | None, why: str) -> None:
    import torch

    if not hasattr(torch.library, "get_kernel"):
        pytest.skip(f"torch {torch.__version__} has no write-hook engine")
    env = {**no_compiler(tmp_path), **({"KVGUARD_ENGINE": requested} if requested else {})}
    states, last = engines(plain_python, tmp_path, env)
    assert states == {"compiled": "not available: no C++ compiler (CXX=/nonexistent/c++ was not found; "
                                  "set CXX to a C++ compiler)", "kernels": "available", "mode": "available"}
    assert last == f"a guard would use: kernels ({why})"
    assert not (tmp_path / "cache").exists()


# 6. A source checkout: kvguard's metadata names integrations that are not installed there.

@pytest.fixture
def checkout_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv whose only kvguard is this source checkout on PYTHONPATH: `kvguard.egg-info`'s
    rank-tag entry point names `kvguard_megatron`, which is not importable from it."""
    home = tmp_path_factory.mktemp("checkout-venv")
    python, _ = _venv_with_test_deps(home)
    probe = run(python, "-c", "import importlib.util as u; print(u.find_spec('kvguard_megatron'))", cwd=home)
    assert probe.stdout == "None\n", "the integration must not be importable in this venv"
    return python


def test_run_from_a_checkout_without_the_integration_is_quiet(checkout_python: Path, job: Path) -> None:
    result = kvguard_run(checkout_python, "--targets", "cleanjob:step(batch)",
                         code="import cleanjob, torch; cleanjob.step({'t': torch.ones(1)})", cwd=job)
    assert result.returncode == 0, result.stderr
    assert CLEAN_SUMMARY.fullmatch(result.stderr), result.stderr  # no "rank tags ... unavailable"


def test_install_pth_from_a_checkout_without_the_integration_is_quiet(checkout_python: Path, job: Path) -> None:
    installed = run(checkout_python, "-m", "kvguard", "install-pth", cwd=job)
    assert installed.returncode == 0 and installed.stderr == "", installed.stderr
    result = run(checkout_python, "-c", "import cleanjob, torch; cleanjob.step({'t': torch.ones(1)})", cwd=job,
                 env={"KVGUARD": "warn", "KVGUARD_TARGETS": "cleanjob:step(batch)"}, pythonpath=(ROOT, job))
    assert CLEAN_SUMMARY.fullmatch(result.stderr), result.stderr


def _tag_distribution(where: Path, name: str, module_source: str | None) -> None:
    """An installed distribution registering `NAME:rank_tags` as kvguard rank tags (its module optional)."""
    info = where / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[kvguard.rank_tags]\n{name} = {name}:rank_tags\n")
    if module_source is not None:
        (where / f"{name}.py").write_text(module_source)


def test_a_broken_installed_integration_is_one_line_an_absent_one_none(plain_python: Path, job: Path,
                                                                       tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    _tag_distribution(plugins, "ghosttags", None)  # metadata only: not installed here
    _tag_distribution(plugins, "brokentags", "import kvguard_no_such_dependency\n")  # installed, but broken
    _tag_distribution(plugins, "goodtags", "def rank_tags():\n    return {'zone': 'b'}\n")
    result = kvguard_run(plain_python, "--targets", "dirtyjob:step(batch)", "--action", "record",
                         code="import dirtyjob, torch; dirtyjob.step({'x': torch.ones(1)})", cwd=job,
                         env={"RANK": "0", "WORLD_SIZE": "1"}, pythonpath=(ROOT, plugins))
    lines = result.stderr.splitlines()
    assert [line for line in lines if "rank tags" in line] == [
        "kvguard: rank tags from brokentags:rank_tags unavailable: No module named 'kvguard_no_such_dependency'"]
    assert "ghosttags" not in result.stderr
    assert lines[1].startswith("kvguard [rank 0/1 zone=b]: dirtyjob:step(batch): 1 guarded call"), lines


# 7. --version.

@pytest.mark.parametrize("command", [["-m", "kvguard"], ["-c", "import sys, kvguard.__main__ as m; "
                                                                "sys.argv[0] = 'kvguard'; sys.exit(m.main())"]])
def test_version_is_printed(plain_python: Path, tmp_path: Path, command: list[str]) -> None:
    import torch

    result = run(plain_python, *command, "--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"kvguard {kvguard.__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})\n"


def test_version_names_torchs_own_version_not_its_wheels(plain_python: Path, tmp_path: Path) -> None:
    # The index's CUDA wheels say `2.13.0` in their metadata and `2.13.0+cu130` in torch.__version__:
    # --version says what torch says, still without importing it (this torch fails to import).
    fake = tmp_path / "fake-site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('--version imported torch')\n")
    (fake / "torch" / "version.py").write_text("__version__ = '9.8.7+cu999'\ngit_version = 'abc'\n")
    (fake / "torch-9.8.7.dist-info").mkdir()
    (fake / "torch-9.8.7.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.8.7\n")
    result = run(plain_python, "-m", "kvguard", "--version", cwd=tmp_path, pythonpath=(fake, ROOT))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"kvguard {kvguard.__version__} (torch 9.8.7+cu999, Python {sys.version.split()[0]})\n"


def test_version_flag_without_a_command_is_still_a_usage_error(plain_python: Path, tmp_path: Path) -> None:
    result = run(plain_python, "-m", "kvguard", cwd=tmp_path)
    assert result.returncode == 2 and "required: command" in result.stderr


def test_the_readme_and_the_build_line_give_one_build_time() -> None:
    """What the first guard prints while it builds and what the README says are the same figures."""
    import inspect

    from kvguard._native import build as _build

    printed = re.search(r"compiling takes about (\d+) s, (\d+) s of CPU", inspect.getsource(_build._compile))
    assert printed is not None
    readme = (ROOT / "README.md").read_text()
    engines = " ".join((ROOT / "docs" / "engines.md").read_text().split())  # the build, in the docs
    assert f"the C++ compile takes about\n{printed[1]} s, {printed[2]} s of CPU time" in readme
    assert "`python -m kvguard build` into an empty `KVGUARD_CACHE_DIR` took" in engines  # what was measured
    assert f"({printed[2]} s of CPU time" in engines
    assert "about 15 s" not in readme + engines and "about 20 s" not in readme + engines
