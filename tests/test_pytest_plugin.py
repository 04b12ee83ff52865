"""The pytest plugin, run through `pytester`: outcomes, failure text, settings and their sources.

Inner runs are in-process (torch is already imported here); the import-cost check, the
xdist runs and the run with every installed plugin autoloaded start fresh interpreters.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest

from kvguard._activate.pytest_off import BLOCKED_HEADER
from kvguard._activate.pytest_plugin import ENV_NOTE
from kvguard._activate.pytest_plugin import header as plugin_header

pytest_plugins = ["pytester"]

# Inner runs load only this plugin: others (hypothesis) would re-import themselves on every
# in-process run. Installed (even editable), `-p kvguard` names the pytest11 entry point;
# from a bare checkout, load the module itself.
# Every distribution's, as pytest loads them (a checkout's stale kvguard.egg-info may come first).
ENTRY_POINTS = {ep.name for dist in importlib.metadata.distributions() for ep in dist.entry_points
                if ep.group == "pytest11"}
INSTALLED = "kvguard" in ENTRY_POINTS
LOAD = ("--disable-plugin-autoload", "-p", "kvguard" if INSTALLED else "kvguard._activate.pytest_plugin")
# `-p no:kvguard` with the second entry point (or its module, from a bare checkout) loaded.
BLOCK = ("--disable-plugin-autoload", "-p", "no:kvguard",
         "-p", "kvguard_off" if "kvguard_off" in ENTRY_POINTS else "kvguard._activate.pytest_off")

CONFTEST = """
import pytest, torch

@pytest.fixture
def batch():
    return {"kl": [torch.ones(4), torch.ones(4)], "step": 3}
"""

# One file with every way a test meets the plugin; each test selects what it needs with -k.
TESTS = """
import pytest, torch, kvguard

def test_fixture(mutation_guard, batch):
    mutation_guard.protect(batch, name="batch")
    k = batch["kl"][1]
    k *= 2

def test_fixture_clean(mutation_guard, batch):
    g = mutation_guard.protect(batch, name="batch")
    k = batch["kl"][1] * 2
    assert g.report.ok

def test_fixture_two_guards(mutation_guard, batch):
    other = [torch.zeros(2)]
    mutation_guard.protect(batch, name="batch")
    g = mutation_guard.protect(other, name="other", action="raise")
    with pytest.raises(kvguard.MutationError, match=r"other\\[0\\] would be modified"):
        other[0].add_(1)
    assert len(g.report.events) == 1

@pytest.fixture
def guarded_batch(mutation_guard, batch):
    mutation_guard.protect(batch, name="guarded_batch")
    return batch

def test_fixture_from_fixture(guarded_batch):
    guarded_batch["kl"][0].zero_()

@pytest.mark.kvguard(arg="batch")
def test_marker(batch):
    batch["kl"][0].add_(1)

@pytest.mark.kvguard(arg="batch", keys=["kl"])
def test_marker_keys(batch):
    batch["extra"] = t = torch.ones(2)
    t.add_(1)

@pytest.mark.kvguard(arg="batch", keys=["step"])
def test_marker_guarding_nothing(batch):
    batch["kl"][0].add_(1)

@pytest.mark.kvguard(arg="rollout")
def test_marker_missing(batch):
    pass

@pytest.mark.parametrize("x", [[torch.ones(2)]])
@pytest.mark.kvguard
def test_marker_all(x, batch):
    x[0].sub_(1)

@pytest.mark.kvguard(arg="batch")
def test_marker_exit_check(batch):
    batch["kl"][0].numpy()[0] = 5.0  # numpy writes dispatch nothing: the exit check finds it

@pytest.mark.kvguard(arg="batch", action="record")
def test_marker_record(batch):
    batch["kl"][0].add_(1)
    batch["kl"][1].mul_(3)

@pytest.mark.kvguard(arg="batch", action="raise")
def test_marker_explicit(batch):
    batch["kl"][0].add_(1)
"""


@pytest.fixture(scope="module", autouse=True)
def _engine_loaded() -> None:
    """Catch one write here first: in-process runs unload what they import, and the first
    write imports torch._dynamo (about 2 s each time otherwise)."""
    import torch

    import kvguard

    warm_up = [torch.ones(1)]
    with kvguard.guard(warm_up, action="record"):
        warm_up[0].add_(1)


@pytest.fixture(autouse=True)
def _no_kvguard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGUARD", raising=False)


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=TESTS)
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*LOAD, *args)


def header(action: str, source: str) -> str:
    return plugin_header(action, source)


def assert_output(result: pytest.RunResult, *fragments: str, absent: str = "\0") -> None:
    """Each fragment appears in the output, in this order (plain text: paths have brackets)."""
    text, at = result.stdout.str(), 0
    for fragment in fragments:
        found = text.find(fragment, at)
        assert found >= 0, f"{fragment!r} not found in order in:\n{text}"
        at = found + len(fragment)
    assert absent not in text, f"{absent!r} should not be in:\n{text}"


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = "import sys, kvguard._activate.pytest_plugin; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fixture_write_fails_the_test_with_the_report(project: pytest.Pytester) -> None:
    result = run(project, "-k", "test_fixture and not clean and not two and not from")
    result.assert_outcomes(failed=1)
    assert_output(result,
                  "E       kvguard.MutationError: batch['kl'][1] would be modified in place by "
                  "aten.mul_.Tensor at test_inner.py:6",
                  "E         code     k *= 2",
                  "test_inner.py:6: MutationError",
                  absent="_mode.py")  # the traceback ends at the user's write


def test_fixture_clean_and_several_guards(project: pytest.Pytester) -> None:
    run(project, "-k", "clean or two_guards").assert_outcomes(passed=2)


def test_fixture_protect_from_a_fixture(project: pytest.Pytester) -> None:
    result = run(project, "-k", "from_fixture")
    result.assert_outcomes(failed=1)
    assert_output(result, "guarded_batch['kl'][0] would be modified in place by aten.zero_.default")


def test_marker_guards_the_named_arg(project: pytest.Pytester) -> None:
    result = run(project, "-k", "test_marker and not keys and not missing and not all and not exit"
                               " and not record and not explicit and not nothing")
    result.assert_outcomes(failed=1)
    assert_output(result, "batch['kl'][0] would be modified in place by aten.add_.Tensor")


def test_marker_passes_keys_through(project: pytest.Pytester) -> None:
    run(project, "-k", "marker_keys").assert_outcomes(passed=1)


def test_a_guard_that_protected_nothing_fails_under_warnings_as_errors(project: pytest.Pytester) -> None:
    result = run(project, "-k", "marker_guarding_nothing")  # this suite runs with filterwarnings = error
    result.assert_outcomes(failed=1)
    assert_output(result, "GuardWarning: kvguard.guard(batch) protected no tensor: batch held none while "
                          "the guard was active")


def test_marker_without_arg_guards_every_funcarg_with_tensors(project: pytest.Pytester) -> None:
    result = run(project, "-k", "marker_all")
    result.assert_outcomes(failed=1)
    assert_output(result, "x[0] would be modified in place by aten.sub_.Tensor")


def test_marker_missing_arg_names_it_and_the_available_ones(project: pytest.Pytester) -> None:
    result = run(project, "-k", "marker_missing")
    result.assert_outcomes(failed=1)
    assert_output(result, "@pytest.mark.kvguard(arg='rollout'): test_marker_missing has no argument "
                          "or fixture 'rollout'; available: batch")


def test_exit_check_is_a_failure_not_an_error(project: pytest.Pytester) -> None:
    result = run(project, "-k", "exit_check")
    result.assert_outcomes(failed=1)
    assert_output(result, "batch['kl'][0] changed during the guard, but no dispatched op wrote it")


def test_record_fails_after_the_call_with_every_diff(project: pytest.Pytester) -> None:
    result = run(project, "-k", "marker_record")
    result.assert_outcomes(failed=1)
    assert_output(result,
                  "batch['kl'][0] was modified in place by aten.add_.Tensor at test_inner.py:",
                  "after    [2, 2, 2, 2]",
                  "batch['kl'][1] was modified in place by aten.mul_.Tensor at test_inner.py:",
                  "after    [3, 3, 3, 3]")


# -- a test that writes a protected tensor never passes while the checks are on ------------

# The tests of a user's suite, each run under the session actions below. Names start with
# `test_ambient` so that no selection of the file above picks them up.
AMBIENT_TESTS = """
import pytest, torch, kvguard

def test_ambient_fixture(mutation_guard, batch):
    mutation_guard.protect(batch, name="batch")
    batch["kl"][0].add_(1)
    batch["kl"][1].mul_(3)
    for _ in range(3):
        batch["kl"][1].sub_(1)   # the same site three times: three writes, each listed

@pytest.mark.kvguard(arg="batch")
def test_ambient_marker(batch):
    batch["kl"][0].add_(1)

@pytest.mark.kvguard(arg="batch", action="warn")
def test_ambient_marker_asks_for_warn(batch):
    batch["kl"][0].add_(1)

def test_ambient_protect_asks_for_record(mutation_guard, batch):
    g = mutation_guard.protect(batch, name="batch", action="record")
    batch["kl"][0].add_(1)
    assert len(g.report.events) == 1  # the test may look at the report: it fails all the same

@pytest.mark.kvguard(arg="batch")
def test_ambient_own_assert_fails_first(batch):
    batch["kl"][0].add_(1)
    assert batch["kl"][0].sum() == 4, "the data changed"

def test_ambient_clean(mutation_guard, batch):
    mutation_guard.protect(batch, name="batch")
    assert (batch["kl"][0] * 2).sum() == 8
"""

# What the three protecting tests look like once the checks are off: each passes.
OFF_TESTS = """
import pytest, torch, kvguard

def test_off_fixture(mutation_guard, batch):
    g = mutation_guard.protect(batch, name="batch")
    batch["kl"][0].add_(1)
    assert g.report.ok

@pytest.mark.kvguard(arg="batch", action="raise")
def test_off_marker_with_explicit_action(batch):
    batch["kl"][0].add_(1)

@pytest.mark.kvguard
def test_off_plain_marker(batch):
    batch["kl"][0].add_(1)

def test_off_unguarded(batch):
    pass
"""


@pytest.fixture
def ambient(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_ambient=AMBIENT_TESTS)
    return pytester


@pytest.fixture
def off_project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_off=OFF_TESTS)
    return pytester


@pytest.mark.parametrize("env", ["warn", "record", "0", "off", "1"])
def test_the_kvguard_variable_of_the_shell_does_not_let_a_write_pass(ambient: pytest.Pytester,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    env: str) -> None:
    """A user who just ran a job with `KVGUARD=warn` (or switched it off with 0) still has a
    regression suite that fails: the session action stays the default, raise, at the write."""
    monkeypatch.setenv("KVGUARD", env)
    result = run(ambient, "-k", "test_ambient_fixture or test_ambient_marker and not asks")
    result.assert_outcomes(failed=2)
    assert_output(result, header("raise", "default"), ENV_NOTE.format(var="KVGUARD", value=env),
                  "E       kvguard.MutationError: batch['kl'][0] would be modified in place by aten.add_.Tensor",
                  "action   raised before the write; the data is intact")


@pytest.mark.parametrize("action", ["warn", "record"])
def test_warn_and_record_fail_at_the_end_with_every_write(ambient: pytest.Pytester, action: str) -> None:
    result = run(ambient, f"--kvguard={action}", "-k", "test_ambient_fixture or test_ambient_marker and not asks")
    result.assert_outcomes(failed=2)
    text = result.stdout.str()
    assert_output(result, header(action, "--kvguard"),
                  "batch['kl'][0] was modified in place by aten.add_.Tensor at test_ambient.py:5",
                  "batch['kl'][1] was modified in place by aten.mul_.Tensor at test_ambient.py:6",
                  "batch['kl'][1] was modified in place by aten.sub_.Tensor at test_ambient.py:8",
                  "FAILED test_ambient.py::test_ambient_fixture",
                  "FAILED test_ambient.py::test_ambient_marker")
    assert text.count("modified in place by aten.sub_.Tensor at test_ambient.py:8") >= 3, text
    assert "would be modified" not in text  # nothing was blocked: the writes went through


@pytest.mark.parametrize("session", [(), ("--kvguard=raise",), ("--kvguard=warn",)])
def test_an_explicit_warn_or_record_fails_the_test_at_its_end(ambient: pytest.Pytester,
                                                               session: tuple[str, ...]) -> None:
    """A test that asks for warn or record chose how to fail, not whether."""
    result = run(ambient, *session, "-k", "asks")
    result.assert_outcomes(failed=2)
    assert_output(result, "batch['kl'][0] was modified in place by aten.add_.Tensor at test_ambient.py:",
                  absent="would be modified")


def test_a_test_failing_on_its_own_shows_the_writes_beside_its_error(ambient: pytest.Pytester) -> None:
    result = run(ambient, "--kvguard=record", "-k", "own_assert")
    result.assert_outcomes(failed=1)
    assert_output(result, "AssertionError: the data changed", "kvguard writes",
                  "batch['kl'][0] was modified in place by aten.add_.Tensor at test_ambient.py:")


def test_warn_under_warnings_as_errors_fails_once_per_write(ambient: pytest.Pytester) -> None:
    """`filterwarnings = error` makes each MutationWarning a failure too: the report says it once."""
    ambient.makeini("[pytest]\nfilterwarnings =\n    error\n")
    result = run(ambient, "--kvguard=warn", "-k", "test_ambient_marker and not asks")
    result.assert_outcomes(failed=1)
    assert "MutationWarning: " not in result.stdout.str()
    assert_output(result, "batch['kl'][0] was modified in place by aten.add_.Tensor")


@pytest.mark.parametrize("action", ["warn", "record"])
def test_a_fixture_guard_that_saw_a_write_errors_at_teardown(project: pytest.Pytester, action: str) -> None:
    result = run(project, f"--kvguard={action}", "-k", "from_fixture")
    result.assert_outcomes(passed=1, errors=1)  # the call ran to its end; the fixture's guard reports
    assert_output(result, "guarded_batch['kl'][0] was modified in place by aten.zero_.default")


def test_clean_tests_pass_under_every_action(ambient: pytest.Pytester) -> None:
    for action in ("raise", "warn", "record", "off"):
        run(ambient, f"--kvguard={action}", "-k", "clean").assert_outcomes(passed=1)


def test_off_turns_off_every_check_and_counts_the_tests_that_asked(off_project: pytest.Pytester) -> None:
    result = run(off_project, "--kvguard=off")
    result.assert_outcomes(passed=4)
    assert_output(result, header("off", "--kvguard"),
                  "kvguard: 3 tests asked for kvguard checks that were off (action=off from --kvguard): "
                  "test_off.py::test_off_fixture, test_off.py::test_off_marker_with_explicit_action, "
                  "test_off.py::test_off_plain_marker")


def test_off_from_the_ini_file_says_where_it_came_from(off_project: pytest.Pytester) -> None:
    off_project.makeini("[pytest]\nkvguard_action = off\n")
    result = run(off_project, "-k", "plain_marker")
    result.assert_outcomes(passed=1)
    assert_output(result, header("off", "kvguard_action in tox.ini"),
                  "kvguard: 1 test asked for kvguard checks that were off (action=off from kvguard_action in tox.ini)")


def test_on_no_summary_line_about_off_checks(off_project: pytest.Pytester) -> None:
    result = run(off_project, "-k", "unguarded")
    result.assert_outcomes(passed=1)
    assert "asked for kvguard checks" not in result.stdout.str()


def test_header_default(project: pytest.Pytester) -> None:
    run(project, "-k", "clean").stdout.fnmatch_lines([header("raise", "default")])


@pytest.mark.parametrize(("ini", "env", "cli", "expected"), [
    ("warn", None, None, header("warn", "kvguard_action in tox.ini")),
    ("record", "raise", None, header("record", "kvguard_action in tox.ini")),
    ("raise", "off", "--kvguard=record", header("record", "--kvguard")),
], ids=["ini", "env-is-not-read", "cli-beats-ini"])
def test_precedence(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                    ini: str, env: str | None, cli: str | None, expected: str) -> None:
    project.makeini(f"[pytest]\nkvguard_action = {ini}\n")
    if env is not None:
        monkeypatch.setenv("KVGUARD", env)
    result = run(project, *([cli] if cli else []), "-k", "clean")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([expected])


def test_marker_beats_cli(project: pytest.Pytester) -> None:
    run(project, "--kvguard=warn", "-k", "explicit").assert_outcomes(failed=1)


@pytest.mark.parametrize(("setup", "source"), [
    ({"args": ["--kvguard=rase"]}, "--kvguard"),
    ({"ini": "rase"}, "kvguard_action in tox.ini"),
], ids=["cli", "ini"])
def test_bad_value_is_a_usage_error_naming_its_source(project: pytest.Pytester, setup: dict, source: str) -> None:
    if "ini" in setup:
        project.makeini(f"[pytest]\nkvguard_action = {setup['ini']}\n")
    result = run(project, *setup.get("args", []))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: invalid action 'rase' from {source}; expected *"])


def test_a_bad_kvguard_variable_is_no_usage_error_of_the_tests(project: pytest.Pytester,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD", "rase")
    result = run(project, "-k", "clean")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([ENV_NOTE.format(var="KVGUARD", value="rase")])


# -- -p no:kvguard ---------------------------------------------------------------------------

def test_blocked_plugin_keeps_marker_and_fixture_and_says_they_are_off(off_project: pytest.Pytester) -> None:
    off_project.makeini("[pytest]\nkvguard_action = raise\n")
    result = run_blocked(off_project, "--strict-markers", "--strict-config", "--kvguard=raise")
    result.assert_outcomes(passed=4)
    assert_output(result, BLOCKED_HEADER,
                  "kvguard: 3 tests asked for kvguard checks that were off (-p no:kvguard): "
                  "test_off.py::test_off_fixture, test_off.py::test_off_marker_with_explicit_action, "
                  "test_off.py::test_off_plain_marker", absent="kvguard: action=")


def test_blocked_plugin_lists_the_marker_and_the_ignored_option(pytester: pytest.Pytester) -> None:
    assert_output(run_blocked(pytester, "--markers"), "@pytest.mark.kvguard(arg=None, *, action=None")
    assert_output(run_blocked(pytester, "--help"), "--kvguard=ACTION", "Ignored: -p no:kvguard blocks")


def test_the_second_entry_point_is_inert_next_to_the_plugin(project: pytest.Pytester) -> None:
    """Both loaded (as an installed kvguard always has them): no clash, the plugin decides."""
    second = "kvguard_off" if "kvguard_off" in ENTRY_POINTS else "kvguard._activate.pytest_off"
    result = project.runpytest(*LOAD, "-p", second, "-k", "test_fixture and not clean and not two and not from")
    result.assert_outcomes(failed=1)
    assert_output(result, header("raise", "default"), absent=BLOCKED_HEADER)


def test_the_plugin_loaded_by_its_module_name_wins_over_the_block(project: pytest.Pytester) -> None:
    """`-p no:kvguard -p kvguard._activate.pytest_plugin`: the plugin runs, the second entry point stays out."""
    result = project.runpytest(*BLOCK, "-p", "kvguard._activate.pytest_plugin", "-k", "marker_all")
    result.assert_outcomes(failed=1)
    assert_output(result, header("raise", "default"), "x[0] would be modified in place", absent=BLOCKED_HEADER)


def run_blocked(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*BLOCK, *args)


@pytest.mark.skipif("kvguard_off" not in ENTRY_POINTS, reason="the installed entry points (pip install -e .)")
def test_no_kvguard_with_every_installed_plugin(off_project: pytest.Pytester) -> None:
    """As a user types it: autoload on, the entry points as installed, in a fresh interpreter."""
    result = off_project.runpytest_subprocess("-p", "no:kvguard", "-p", "no:hypothesispytest",
                                              "-p", "no:xdist", "--strict-markers")
    result.assert_outcomes(passed=4)
    assert_output(result, BLOCKED_HEADER, "kvguard: 3 tests asked for kvguard checks that were off",
                  absent="kvguard: action=")


# -- pytest-xdist: the off count is kept by the controller --------------------------------------

XDIST = pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed")


@XDIST
@pytest.mark.parametrize("blocked", [False, True], ids=["off", "blocked"])
def test_off_count_under_xdist(pytester: pytest.Pytester, blocked: bool) -> None:
    """Workers mark the reports, the controller counts: torch-free tests, so workers start fast."""
    pytester.makepyfile(test_off_xdist="""
        import pytest

        @pytest.mark.parametrize("i", range(4))
        def test_protect(mutation_guard, i):
            mutation_guard.protect({"kl": [float(i)]}, name="batch")

        @pytest.mark.kvguard(action="record")
        def test_marker():
            pass

        def test_unguarded():
            pass
    """)
    load = (BLOCK if blocked else LOAD) + ("-p", "xdist", "-n", "2")
    result = pytester.runpytest_subprocess(*load, *(() if blocked else ("--kvguard=off",)))
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["kvguard: 5 tests asked for kvguard checks that were off (*): *"])


def test_help_and_markers(pytester: pytest.Pytester) -> None:
    assert_output(run(pytester, "--help"), "--kvguard=ACTION", "kvguard_action (string):")
    assert_output(run(pytester, "--markers"), "@pytest.mark.kvguard(arg=None, *, action=None")
