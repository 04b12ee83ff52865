"""The pytest plugin: `--kvguard`, its ini twin, the `kvguard` marker, the `mutation_guard` fixture.

Loaded in every pytest run where kvguard is installed (entry point `pytest11`), so it
imports only kvguard's torch-free modules; torch loads when a guard is first entered.

    def test_advantages(mutation_guard, rollout_data):
        mutation_guard.protect(rollout_data, name="rollout_data")
        compute_advantages_and_returns(args, rollout_data)

    @pytest.mark.kvguard(arg="rollout_data")        # or no arg: every funcarg holding tensors
    def test_advantages(rollout_data): ...

A test that writes a protected tensor never passes while the checks are on. The action
only says where it fails:

- raise (the default): the write raises `MutationError` inside the test call, so the test
  FAILS at that line with the report as its message, and the data is intact. A change
  only the exit check sees fails the test after the call.
- record: writes go through, and after the call the test FAILS with the report of every
  write and its diff (to see all the mutations at once rather than the first).
- warn: as record, and each write's panel is printed (and warned) when it happens.
- off: `protect()` and the marker guard nothing; the header says so, and the terminal
  summary counts the tests that asked for checks.

The session's action comes from, highest first: `--kvguard`, the `kvguard_action` ini
key, then "raise". The `KVGUARD` environment variable is not read here: it switches env
activation of `KVGUARD_TARGETS` in a job, and the value a user's shell still holds from
the last job (`warn`, `0`) must not decide whether a regression test can fail (CI sets
`PYTEST_ADDOPTS=--kvguard=record` instead). The header notes it when it is set.

A test chooses how it fails with the marker's `action=` (or `protect(action=...)`),
which beats the session's action; `warn` and `record` chosen there fail the test at its
end as well: a test that wants to look at writes without failing uses `kvguard.guard()`
itself. "off" is a switch, not a way to fail: `--kvguard=off` turns off every check,
explicit `action=` included, and `action="off"` turns off that one test's.

`-p no:kvguard` blocks this module; the second entry point, `kvguard._activate.pytest_off`, then
keeps the marker and the fixture working as "off" and says so (see that module).

Guards entered during the test call (the marker's, and `protect()` from the test body) are
exited in a `pytest_runtest_call` wrapper, so what they find is a failure, not an error.
A guard protected from inside a fixture lives until `mutation_guard` is torn down (so
the stack of dispatch modes stays in order); what its exit check finds is then an ERROR.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Collection, Generator, Iterator, Optional, TypedDict

import pytest

from kvguard._activate.pytest_off import MARKER_HELP, OffLedger
from kvguard._config import OFF, parse_action
from kvguard._errors import ConfigError
from kvguard._report.events import MutationError, MutationWarning

if TYPE_CHECKING:
    from kvguard._guard.guard import Guard
    from kvguard._protect.frames import Site

ACTION_HELP = ("What a kvguard guard does on an in-place write to a protected tensor: raise "
               "(fail the test at the write), record (fail at the end of the test with every "
               "write and its diff), warn (as record, and print each write as it happens) or "
               "off. Default: raise. The KVGUARD environment variable does not set it.")
INI_HELP = "Default for --kvguard: raise, warn, record or off."
HEADER = "kvguard: action={action} (from {source}): {effect}"
EFFECTS = {
    "raise": "a write to a protected tensor fails the test at the write",
    "record": "a write to a protected tensor fails the test at its end, every write listed",
    "warn": "a write to a protected tensor is printed, and fails the test at its end, every write listed",
    OFF: "mutation_guard.protect() and @pytest.mark.kvguard check nothing",
}
ENV_NOTE = ("kvguard: {var}={value!r} in the environment is for env activation (KVGUARD_TARGETS); "
            "it does not set the tests' action (--kvguard or kvguard_action do)")
ENV_VAR = "KVGUARD"
DEFAULT = "raise"
REPORTED = ("warn", "record")  # actions whose writes go through: the test fails at its end

_SETTING = pytest.StashKey[tuple[str, str]]()  # (action, where it came from)
_GUARDS = pytest.StashKey[list["Guard"]]()  # guards open on a test item, in the order entered
_LEDGER = pytest.StashKey[OffLedger]()  # under --kvguard=off: the tests that asked for checks


def header(action: str, source: str) -> str:
    """The report-header line for the session's action."""
    return HEADER.format(action=action, source=source, effect=EFFECTS[action])


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvguard", "catch in-place writes to protected tensors")
    try:
        group.addoption("--kvguard", dest="kvguard", metavar="ACTION", default=None, help=ACTION_HELP)
    except ValueError:  # `-p no:kvguard -p kvguard._activate.pytest_off -p kvguard._activate.pytest_plugin`: the same option
        pass
    parser.addini("kvguard_action", INI_HELP, default=None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    try:
        config.stash[_SETTING] = action, source = _effective_action(config)
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    if action == OFF:
        config.stash[_LEDGER] = ledger = OffLedger(f"action=off from {source}")
        config.pluginmanager.register(ledger, "kvguard-off-ledger")
    from kvguard._activate.startup import not_activated_hint

    hint = not_activated_hint()
    if hint:
        from kvguard._text import say

        say(hint)


def _effective_action(config: pytest.Config) -> tuple[str, str]:
    # Lowest first: 1) default, 2) ini, 3) command line (the marker is per test).
    inifile = config.inipath.name if config.inipath else "the ini file"
    sources = [
        (config.getoption("kvguard"), "--kvguard"),
        (config.getini("kvguard_action"), f"kvguard_action in {inifile}"),
    ]
    for value, where in sources:
        if value is not None and str(value).strip():
            return parse_action(str(value), where), where
    return DEFAULT, "default"


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [header(*config.stash[_SETTING])]
    ambient = os.environ.get(ENV_VAR, "").strip()
    if ambient:
        lines.append(ENV_NOTE.format(var=ENV_VAR, value=ambient))
    return lines


class MutationGuardFixture:
    """What the `mutation_guard` fixture gives a test: `protect(obj, name=..., **options)`."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item

    def protect(self, obj: Any, name: Optional[str] = None, *, action: Optional[str] = None,
                keys: Optional[Collection[object]] = None, ignore: Optional[Collection[object]] = None) -> Guard:
        """Guard `obj` for the rest of the test and return the `kvguard.Guard`.

        Without `action`, the session's setting applies. A write fails the test under
        every action but "off"; then the guard returned is never entered, its report
        stays empty, and the terminal summary counts the test.
        """
        from kvguard._guard.guard import Guard

        resolved = _resolve(self._item, action, "mutation_guard.protect()")
        g = Guard(obj, name=name, action=resolved if resolved != OFF else "record", keys=keys, ignore=ignore)
        if resolved != OFF:
            _enter(self._item, g)
        return g


@pytest.fixture
def mutation_guard(request: pytest.FixtureRequest) -> Iterator[MutationGuardFixture]:
    """Guard tensors for the rest of the test: `mutation_guard.protect(batch, name="batch")`."""
    yield MutationGuardFixture(request.node)
    # Guards entered during the call are closed by the call wrapper; these came from fixtures.
    failures = _close(request.node, 0, None)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    from kvguard._report.process import PROCESS

    PROCESS.shown.clear()  # as pytest resets warning registries: each test shows its own first write per site
    start = len(item.stash.setdefault(_GUARDS, []))
    try:
        _enter_marked(item)
        result = yield
    except BaseException as exc:
        writes = _close(item, start, exc)
        if writes:  # the test failed on its own (an assert on data a write changed?): show them
            item.add_report_section("call", "kvguard writes", "\n\n".join(writes))
        if isinstance(exc, MutationError):
            from kvguard._protect.frames import drop_internal_frames

            drop_internal_frames(exc)
        raise
    failures = _close(item, start, None)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    return result


def _resolve(item: pytest.Item, action: Optional[str], where: str) -> str:
    """The action for one guard: its own `action=`, else the session's; "off" when the
    session is off (noted for the summary: the test asked for a check)."""
    ledger = item.config.stash.get(_LEDGER, None)
    if ledger is not None:
        ledger.note(item)
        return OFF
    try:
        resolved = item.config.stash[_SETTING][0] if action is None else parse_action(action, where)
    except ConfigError as exc:
        pytest.fail(str(exc), pytrace=False)
    return resolved


class _MarkerOptions(TypedDict):
    arg: Optional[str]
    action: Optional[str]
    name: Optional[str]
    keys: Optional[Collection[object]]
    ignore: Optional[Collection[object]]
    autograd: bool


def _marker_options(arg: Optional[str] = None, *, action: Optional[str] = None, name: Optional[str] = None,
                    keys: Optional[Collection[object]] = None, ignore: Optional[Collection[object]] = None,
                    autograd: bool = False) -> _MarkerOptions:
    return dict(arg=arg, action=action, name=name, keys=keys, ignore=ignore, autograd=bool(autograd))


def _enter_marked(item: pytest.Item) -> None:
    marker = item.get_closest_marker("kvguard")
    if marker is None:
        return
    try:
        options = _marker_options(*marker.args, **marker.kwargs)
    except TypeError as exc:
        pytest.fail(f"@pytest.mark.kvguard: {exc}", pytrace=False)
    action = _resolve(item, options["action"], f"@pytest.mark.kvguard on {item.name}")
    if action == OFF:
        return
    funcargs: dict[str, object] = getattr(item, "funcargs", {})
    arg = options["arg"]
    if options["autograd"]:  # what the test's forward passes save; funcargs only when `arg` names one
        from kvguard._guard.autograd import AutogradGuard

        _enter(item, AutogradGuard(name=options["name"], action=action))
        if arg is None:
            return
    if arg is None:
        targets = [(n, v) for n, v in funcargs.items() if _holds_tensor(v)]
    elif arg in funcargs:
        targets = [(arg, funcargs[arg])]
    else:
        pytest.fail(f"@pytest.mark.kvguard(arg={arg!r}): {item.name} has no argument or fixture "
                    f"{arg!r}; available: {', '.join(funcargs) or 'none'}", pytrace=False)
    from kvguard._guard.guard import Guard

    for argname, value in targets:
        _enter(item, Guard(value, name=options["name"] or argname, action=action,
                           keys=options["keys"], ignore=options["ignore"]))


def _holds_tensor(value: object) -> bool:
    from kvguard._guard.target import guardable
    from kvguard._protect.tree import walk

    torch = sys.modules.get("torch")  # not imported yet: no tensors to guard
    if torch is None or not guardable(value):
        return False
    return bool(walk(value, "x", lambda v: isinstance(v, torch.Tensor))[0])


def _enter(item: pytest.Item, g: Guard) -> None:
    g.__enter__()
    item.stash.setdefault(_GUARDS, []).append(g)


def _test_site(item: pytest.Item) -> Optional[Site]:
    from kvguard._protect.frames import Site

    function = getattr(item, "function", None)
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    return Site(code.co_filename, code.co_firstlineno, item.name, f"def {code.co_name}(...)")


def _close(item: pytest.Item, start: int, exc: Optional[BaseException]) -> list[str]:
    """Exit the item's guards entered at or after `start`, innermost first; return failures.

    Under warn and record each guard that saw a write is one failure: its whole report.
    """
    guards = item.stash.get(_GUARDS, [])
    closing, guards[start:] = guards[start:], []
    failures: list[str] = []
    broken: Optional[BaseException] = None
    site = _test_site(item)
    for g in reversed(closing):
        if g.exit_site is None:
            g.exit_site = site  # the exit check's findings point at the test, not at pluggy
        reported = False
        try:
            g.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        except MutationError as err:  # raise mode: a change only the exit check could see
            failures.append(str(err))
        except BaseException as err:  # close the others first, so no dispatch mode leaks
            broken = broken or err
        else:
            if g.action in REPORTED and not g.report.ok:
                failures.append(g.report.format())
                reported = True
        # Warnings a filter turned into errors: kept off the user's ops, they fail the test here
        # (a MutationWarning's write is in the report already).
        failures += [f"{type(w).__name__}: {w}" for w in g.unraised_warnings
                     if not (reported and isinstance(w, MutationWarning))]
    if broken is not None:
        raise broken
    return failures
