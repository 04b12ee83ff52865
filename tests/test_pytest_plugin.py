"""The pytest plugin, run through `pytester`: outcomes, failure text, settings and their sources.

Inner runs are in-process (torch is already imported here); only the import-cost check
starts a fresh interpreter.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from kvguard._pytest_plugin import HEADER

pytest_plugins = ["pytester"]

# Inner runs load only this plugin: others (hypothesis) would re-import themselves on every
# in-process run. Installed (even editable), `-p kvguard` names the pytest11 entry point;
# from a bare checkout, load the module itself.
INSTALLED = any(ep.name == "kvguard" for ep in importlib.metadata.entry_points(group="pytest11"))
LOAD = ("--disable-plugin-autoload", "-p", "kvguard" if INSTALLED else "kvguard._pytest_plugin")

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
    batch["kl"][0].data = torch.zeros(8)

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
    return HEADER.format(action=action, source=source)


def assert_output(result: pytest.RunResult, *fragments: str, absent: str = "\0") -> None:
    """Each fragment appears in the output, in this order (plain text: paths have brackets)."""
    text, at = result.stdout.str(), 0
    for fragment in fragments:
        found = text.find(fragment, at)
        assert found >= 0, f"{fragment!r} not found in order in:\n{text}"
        at = found + len(fragment)
    assert absent not in text, f"{absent!r} should not be in:\n{text}"


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = "import sys, kvguard._pytest_plugin; assert 'torch' not in sys.modules, 'torch imported'"
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


@pytest.mark.filterwarnings("default::kvguard.MutationWarning")  # in-process: ours apply inside
def test_warn_passes_with_a_warning(project: pytest.Pytester) -> None:
    result = run(project, "--kvguard=warn", "-k", "test_fixture and not clean and not two and not from")
    result.assert_outcomes(passed=1, warnings=1)
    assert_output(result, header("warn", "--kvguard"), "MutationWarning: batch['kl'][1] was modified in place")


def test_off_disables_protect_and_plain_markers_but_not_explicit_actions(project: pytest.Pytester) -> None:
    result = run(project, "--kvguard=off", "-k", "test_fixture or test_marker_all or explicit")
    result.assert_outcomes(passed=5, failed=1)
    assert_output(result, header("off", "--kvguard"), "FAILED test_inner.py::test_marker_explicit")


def test_header_default(project: pytest.Pytester) -> None:
    run(project, "-k", "clean").stdout.fnmatch_lines([header("raise", "default")])


@pytest.mark.parametrize(("ini", "env", "cli", "expected"), [
    ("warn", None, None, header("warn", "kvguard_action in tox.ini")),
    ("raise", "1", None, header("warn", "the KVGUARD environment variable")),
    ("raise", "off", "--kvguard=record", header("record", "--kvguard")),
], ids=["ini", "env-beats-ini", "cli-beats-env"])
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
    ({"env": "rase"}, "the KVGUARD environment variable"),
    ({"ini": "rase"}, "kvguard_action in tox.ini"),
], ids=["cli", "env", "ini"])
def test_bad_value_is_a_usage_error_naming_its_source(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                      setup: dict, source: str) -> None:
    if "env" in setup:
        monkeypatch.setenv("KVGUARD", setup["env"])
    if "ini" in setup:
        project.makeini(f"[pytest]\nkvguard_action = {setup['ini']}\n")
    result = run(project, *setup.get("args", []))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: invalid action 'rase' from {source}; expected *"])


@pytest.mark.skipif(not INSTALLED, reason="-p no:kvguard names the pytest11 entry point")
def test_no_kvguard_disables_the_plugin(project: pytest.Pytester) -> None:
    result = project.runpytest("-p", "no:kvguard", "-p", "no:hypothesispytest",
                               "-k", "test_fixture_clean or test_marker_all")
    result.assert_outcomes(passed=1, errors=1)
    assert_output(result, "fixture 'mutation_guard' not found", absent="kvguard: action=")


def test_help_and_markers(pytester: pytest.Pytester) -> None:
    assert_output(run(pytester, "--help"), "--kvguard=ACTION", "kvguard_action (string):")
    assert_output(run(pytester, "--markers"), "@pytest.mark.kvguard(arg=None, *, action=None")
