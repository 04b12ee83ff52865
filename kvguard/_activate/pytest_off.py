"""kvguard's second pytest entry point (`kvguard_off`): what a test that asks for checks gets when they are off.

Loaded next to the plugin (`kvguard = kvguard._activate.pytest_plugin`) in every pytest run where
kvguard is installed, and inert unless `-p no:kvguard` blocks that plugin. Then, instead
of an unknown mark (an error under `--strict-markers`) and a missing fixture, it
registers the `kvguard` marker, accepts `--kvguard` and `kvguard_action` (ignored), and
gives `mutation_guard`, whose `protect()` guards nothing; the report header says the
checks are off and why, and the terminal summary counts the tests that asked for them.

`OffLedger` does that counting for the plugin too, under `--kvguard=off`. It works under
pytest-xdist: each worker marks its tests' reports, the controller counts them.

Stdlib and pytest only at import: torch loads in no pytest run that does not use it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Collection, Generator, Iterator, Optional

import pytest

if TYPE_CHECKING:
    from kvguard._guard.guard import Guard

PLUGIN = "kvguard"  # the entry-point name of the plugin that `-p no:kvguard` blocks
MARKER_HELP = ("kvguard(arg=None, *, action=None, name=None, keys=None, ignore=None, autograd=False): fail "
               "the test when it writes in place to a tensor reachable from the funcarg `arg` (default: "
               "every funcarg holding tensors), or with autograd=True to a tensor autograd saved for "
               "backward (kvguard.guard_autograd). See kvguard.guard() for keys and ignore.")
BLOCKED = "-p no:kvguard"
BLOCKED_HEADER = (f"kvguard: off ({BLOCKED} blocks the kvguard plugin): mutation_guard.protect() "
                  "and @pytest.mark.kvguard check nothing")
SUMMARY = "kvguard: {count} {tests} asked for kvguard checks that were off ({why}): {names}"
_SHOWN_NAMES = 5
_REPORT_KEY = "kvguard_off"  # on each report of such a test; travels from xdist workers to the controller


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    if not _plugin_blocked(pluginmanager):
        return
    ignored = f"Ignored: {BLOCKED} blocks the kvguard plugin."
    group = parser.getgroup("kvguard", "catch in-place writes to protected tensors")
    group.addoption("--kvguard", dest="kvguard", metavar="ACTION", default=None, help=ignored)
    parser.addini("kvguard_action", ignored, default=None)


def pytest_configure(config: pytest.Config) -> None:
    if _plugin_blocked(config.pluginmanager):
        config.addinivalue_line("markers", MARKER_HELP)
        config.pluginmanager.register(OffLedger(BLOCKED), "kvguard-off-ledger")
        config.pluginmanager.register(_BlockedPlugin(), "kvguard-blocked")


def _plugin_blocked(pluginmanager: pytest.PytestPluginManager) -> bool:
    """`-p no:kvguard`, and the plugin module not loaded under another name either."""
    module = sys.modules.get("kvguard._activate.pytest_plugin")
    loaded = module is not None and pluginmanager.is_registered(module)
    return pluginmanager.is_blocked(PLUGIN) and not loaded


class OffLedger:
    """Counts the tests that asked for kvguard checks while they were off, for the summary."""

    def __init__(self, why: str) -> None:
        self.why = why
        self.asked: dict[str, None] = {}  # node ids, in order

    @staticmethod
    def note(item: pytest.Item) -> None:
        item.stash[_ASKED] = True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if item.stash.get(_ASKED, False):
            setattr(report, _REPORT_KEY, True)
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if getattr(report, _REPORT_KEY, False):
            self.asked[report.nodeid] = None

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if hasattr(terminalreporter.config, "workerinput"):
            return  # an xdist worker: the controller counts
        if self.asked:
            terminalreporter.write_line(self.summary())

    def summary(self) -> str:
        names = list(self.asked)
        shown = ", ".join(names[:_SHOWN_NAMES]) + (f" … (+{len(names) - _SHOWN_NAMES})"
                                                   if len(names) > _SHOWN_NAMES else "")
        return SUMMARY.format(count=len(names), tests="test" if len(names) == 1 else "tests",
                              why=self.why, names=shown)


_ASKED = pytest.StashKey[bool]()


class OffFixture:
    """`mutation_guard` while the checks are off: `protect()` returns a guard it never enters."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item

    def protect(self, obj: Any, name: Optional[str] = None, *, action: Optional[str] = None,
                keys: Optional[Collection[object]] = None, ignore: Optional[Collection[object]] = None) -> Guard:
        """A `kvguard.Guard` over `obj` that is never entered: its report stays empty."""
        from kvguard._guard.guard import Guard

        OffLedger.note(self._item)
        return Guard(obj, name=name, action="record", keys=keys, ignore=ignore)


class _BlockedPlugin:
    """Registered only under `-p no:kvguard`: the fixture, the marker's count, the header."""

    @pytest.fixture
    def mutation_guard(self, request: pytest.FixtureRequest) -> Iterator[OffFixture]:
        """Off (`-p no:kvguard`): `protect()` guards nothing, and the summary counts the test."""
        yield OffFixture(request.node)

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if item.get_closest_marker("kvguard") is not None:
            OffLedger.note(item)

    def pytest_report_header(self, config: pytest.Config) -> str:
        return BLOCKED_HEADER
