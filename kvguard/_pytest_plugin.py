"""The pytest plugin: `--kvguard`, its ini twin, the `kvguard` marker, the `mutation_guard` fixture.

Loaded in every pytest run where kvguard is installed (entry point `pytest11`), so it
imports only kvguard's torch-free modules; torch loads when a guard is first entered.
Opt out with `-p no:kvguard`.

    def test_advantages(mutation_guard, rollout_data):
        mutation_guard.protect(rollout_data, name="rollout_data")
        compute_advantages_and_returns(args, rollout_data)

    @pytest.mark.kvguard(arg="rollout_data")        # or no arg: every funcarg holding tensors
    def test_advantages(rollout_data): ...

The action comes from, highest first: the marker's `action=` (or `protect(action=...)`),
`--kvguard`, the `KVGUARD` environment variable (empty counts as unset), the
`kvguard_action` ini key, then "raise". "off" makes `protect()` and markers without an
`action=` of their own no-ops. What each action does to a test:

- raise: the write raises `MutationError` inside the test call, so the test FAILS with the
  report as its message; a change only the exit check sees fails the test after the call.
- warn: the test passes; each mutation is a `MutationWarning` in the warnings summary
  (`filterwarnings = error` turns it into a failure, as for any warning).
- record: writes go through, and after the call the test FAILS with the full report of
  every write and its diff. Use it to see all the mutations at once rather than the first.

Guards entered during the test call (the marker's, and `protect()` from the test body) are
exited in a `pytest_runtest_call` wrapper, so what they find is a failure, not an error.
A guard protected from inside a fixture lives until `mutation_guard` is torn down (so
the stack of dispatch modes stays in order); what its exit check finds is then an ERROR.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Collection, Generator, Iterator, Optional

import pytest

from kvguard._config import OFF, parse_action
from kvguard._errors import ConfigError, MutationError

ACTION_HELP = ("What a kvguard guard does on an in-place write to a protected tensor: raise "
               "(fail the test at the write), warn, record (fail after the test with every "
               "write and its diff) or off. Default: raise.")
INI_HELP = "Default for --kvguard: raise, warn, record or off."
MARKER_HELP = ("kvguard(arg=None, *, action=None, name=None, keys=None, ignore=()): fail the test "
               "when it writes in place to a tensor reachable from the funcarg `arg` (default: "
               "every funcarg holding tensors). See kvguard.guard() for keys and ignore.")
HEADER = "kvguard: action={action} (from {source})"
ENV_VAR = "KVGUARD"
DEFAULT = "raise"

_SETTING = pytest.StashKey[tuple[str, str]]()  # (action, where it came from)
_GUARDS = pytest.StashKey[list[Any]]()  # guards open on a test item, in the order entered


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvguard", "catch in-place writes to protected tensors")
    group.addoption("--kvguard", dest="kvguard", metavar="ACTION", default=None, help=ACTION_HELP)
    parser.addini("kvguard_action", INI_HELP, default=None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    try:
        config.stash[_SETTING] = _effective_action(config)
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    from kvguard._startup import not_activated_hint

    hint = not_activated_hint()
    if hint:
        from kvguard._render import say

        say(hint)


def _effective_action(config: pytest.Config) -> tuple[str, str]:
    # Lowest first: 1) default, 2) ini, 3) environment, 4) command line (the marker is per test).
    inifile = config.inipath.name if config.inipath else "the ini file"
    sources = [
        (config.getoption("kvguard"), "--kvguard"),
        (os.environ.get(ENV_VAR), f"the {ENV_VAR} environment variable"),
        (config.getini("kvguard_action"), f"kvguard_action in {inifile}"),
    ]
    for value, where in sources:
        if value is not None and str(value).strip():
            return parse_action(str(value), where), where
    return DEFAULT, "default"


def pytest_report_header(config: pytest.Config) -> str:
    action, source = config.stash[_SETTING]
    return HEADER.format(action=action, source=source)


class MutationGuardFixture:
    """What the `mutation_guard` fixture gives a test: `protect(obj, name=..., **options)`."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item

    def protect(self, obj: Any, name: Optional[str] = None, *, action: Optional[str] = None,
                keys: Optional[Collection[Any]] = None, ignore: Collection[Any] = ()) -> Any:
        """Guard `obj` for the rest of the test and return the `kvguard.Guard`.

        Without `action`, the session's setting applies; when that is "off", the guard
        returned is never entered and its report stays empty.
        """
        from kvguard._guard import Guard

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
    from kvguard._state import STATE

    STATE.shown.clear()  # as pytest resets warning registries: each test shows its own first write per site
    start = len(item.stash.setdefault(_GUARDS, []))
    try:
        _enter_marked(item)
        result = yield
    except BaseException as exc:
        _close(item, start, exc)
        if isinstance(exc, MutationError):
            from kvguard._frames import drop_internal_frames

            drop_internal_frames(exc)
        raise
    failures = _close(item, start, None)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    return result


def _resolve(item: pytest.Item, action: Optional[str], where: str) -> str:
    if action is None:
        return item.config.stash[_SETTING][0]
    try:
        return parse_action(action, where)
    except ConfigError as exc:
        pytest.fail(str(exc), pytrace=False)


def _marker_options(arg: Optional[str] = None, *, action: Optional[str] = None, name: Optional[str] = None,
                    keys: Optional[Collection[Any]] = None, ignore: Collection[Any] = ()) -> dict[str, Any]:
    return dict(arg=arg, action=action, name=name, keys=keys, ignore=ignore)


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
    funcargs: dict[str, Any] = getattr(item, "funcargs", {})
    arg = options["arg"]
    if arg is None:
        targets = [(n, v) for n, v in funcargs.items() if _holds_tensor(v)]
    elif arg in funcargs:
        targets = [(arg, funcargs[arg])]
    else:
        pytest.fail(f"@pytest.mark.kvguard(arg={arg!r}): {item.name} has no argument or fixture "
                    f"{arg!r}; available: {', '.join(funcargs) or 'none'}", pytrace=False)
    from kvguard._guard import Guard

    for argname, value in targets:
        _enter(item, Guard(value, name=options["name"] or argname, action=action,
                           keys=options["keys"], ignore=options["ignore"]))


def _holds_tensor(value: Any) -> bool:
    from kvguard._guard import guardable
    from kvguard._tree import walk

    torch = sys.modules.get("torch")  # not imported yet: no tensors to guard
    if torch is None or not guardable(value):
        return False
    return bool(walk(value, "x", lambda v: isinstance(v, torch.Tensor))[0])


def _enter(item: pytest.Item, g: Any) -> None:
    g.__enter__()
    item.stash.setdefault(_GUARDS, []).append(g)


def _test_site(item: pytest.Item) -> Any:
    from kvguard._frames import Site

    function = getattr(item, "function", None)
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    return Site(code.co_filename, code.co_firstlineno, item.name, f"def {code.co_name}(...)")


def _close(item: pytest.Item, start: int, exc: Optional[BaseException]) -> list[str]:
    """Exit the item's guards entered at or after `start`, innermost first; return failures."""
    guards = item.stash.get(_GUARDS, [])
    closing, guards[start:] = guards[start:], []
    failures: list[str] = []
    broken: Optional[BaseException] = None
    site = _test_site(item)
    for g in reversed(closing):
        if g.exit_site is None:
            g.exit_site = site  # the exit check's findings point at the test, not at pluggy
        try:
            g.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        except MutationError as err:  # raise mode: a change only the exit check could see
            failures.append(str(err))
        except BaseException as err:  # close the others first, so no dispatch mode leaks
            broken = broken or err
        else:
            if exc is None and g.action == "record" and not g.report.ok:
                failures.append(g.report.format())
        # Warnings a filter turned into errors: kept off the user's ops, they fail the test here.
        failures += [f"{type(w).__name__}: {w}" for w in g.unraised_warnings]
    if broken is not None:
        raise broken
    return failures
