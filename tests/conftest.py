"""Shared test fixtures: every test must leave torch as it found it, under every engine.

No dispatch mode left on the stack, and `torch.utils.swap_tensors` (which an active
guard wraps) restored: a guard left open by one test would otherwise change the next.

The tests of what a guard sees run once per engine (`compiled`, `kernels`, `mode`,
see `kvguard._engine.choice`): the `engine` fixture sets `KVGUARD_ENGINE` for the test.
Where the compiled engine cannot be built the tests skip, except under CI, where
they fail: CI has a compiler.

The README's quick command (`-m 'not slow'`) runs each such test under one engine, chosen
from the test's id (stable as tests come and go, each engine a share of every module); the
other engines' runs are marked `slow`, so CI's second tier (`-m slow`) completes the
matrix. A test whose outcome differs between engines (`every_engine`) runs under each in
both. Where the one engine chosen is not available here, the quick run uses another
rather than skip, so no behaviour goes untested on a machine without a compiler.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from kvguard._native import build as _build

# Every subprocess a test starts uses the compiled engine this session built: pytester points
# HOME at a fresh directory, where the default cache holds none (a 15 s build per subprocess).
os.environ.setdefault("KVGUARD_CACHE_DIR", str(_build.cache_root()))
# An xdist worker gets COLUMNS=80 and LINES=24 of its own, which its subprocesses would
# inherit (rich output 80 wide): the tests see the environment the run was started with.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("COLUMNS") == "80" and os.environ.get("LINES") == "24":
    del os.environ["COLUMNS"], os.environ["LINES"]

ENGINES = ("compiled", "kernels", "mode")
# Modules whose tests are about what a guard sees and does: each runs under every engine.
# The others (reports, CLI, start-up, integrations) run under the automatic choice.
PER_ENGINE = {"test_guard", "test_channels", "test_odd_tensors", "test_never_crash", "test_containers",
              "test_fingerprints", "test_cliffs", "test_undeclared_writes", "test_property", "test_engines",
              "test_placements", "test_autograd", "test_weights"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "any_engine: in a per-engine module, run once under the automatic choice")
    config.addinivalue_line("markers", "every_engine: its outcome differs between engines: the quick run "
                            "(-m 'not slow') runs it under every engine, not one")
    config.addinivalue_line("markers", "slow: a test of many processes or a whole tool run (10-30 s of CPU each); "
                            "the README's test command leaves them out (-m 'not slow'), CI runs them too")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if (metafunc.module.__name__.rpartition(".")[2] in PER_ENGINE and "engine" in metafunc.fixturenames
            and metafunc.definition.get_closest_marker("any_engine") is None):
        metafunc.parametrize("engine", ENGINES, indirect=True)


# The fixtures that take an engine as their parameter (`engine` here, and modules' own).
ENGINE_PARAMS = ("engine", "each_engine")


def _engine_of(item: pytest.Item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name in ENGINE_PARAMS:
        if params.get(name) in ENGINES:
            return str(params[name])
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One engine per test in the quick run, the others in the slow tier (see the docstring)."""
    groups: dict[str, list[tuple[pytest.Item, str]]] = {}
    for item in items:
        name = _engine_of(item)
        if name is None or item.get_closest_marker("every_engine") is not None:
            continue
        base, _, ids = item.nodeid.partition("[")
        parts = ids.rstrip("]").split("-")
        parts.remove(name)
        groups.setdefault(base + "[" + "-".join(parts) + "]", []).append((item, name))
    for key, members in groups.items():
        if len(members) < 2:
            continue
        present = sorted({name for _, name in members}, key=ENGINES.index)
        chosen = present[zlib.crc32(key.encode()) % len(present)]
        for item, name in members:
            if name == chosen:
                item.stash[_QUICK] = True
            else:
                item.add_marker(pytest.mark.slow)


_QUICK = pytest.StashKey[bool]()


def _stand_in(name: str) -> str | None:
    """The engine a quick run uses where `name` is not available here (None: none is)."""
    from kvguard._engine import choice as _choice

    return next((other for other in ENGINES if other != name and _choice.why_not(other) is None), None)


@pytest.fixture(autouse=True)
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The engine this test's guards use (`auto` outside the per-engine modules)."""
    name = getattr(request, "param", None)
    if name is None:
        return os.environ.get("KVGUARD_ENGINE") or "auto"
    from kvguard._engine import choice as _choice

    why = _choice.why_not(name)
    if why is not None:
        if os.environ.get("CI") and name == "compiled":
            pytest.fail(f"the compiled engine is not available under CI: {why}")
        other = _stand_in(name) if request.node.stash.get(_QUICK, False) else None
        if other is None:
            pytest.skip(f"the {name} engine is not available here: {why}")
        name = other  # this test's one engine in the quick run: run it under another, not skip it
    monkeypatch.setenv("KVGUARD_ENGINE", name)
    if name != "compiled":  # as where there is no compiler: the protected set reads tensors in Python too
        from kvguard._protect import records as _records

        monkeypatch.setattr(_records, "compiled_describe", lambda: None)
    return name


@pytest.fixture(autouse=True)
def no_leaked_guard():
    before = torch._C._len_torch_dispatch_stack()
    swap = torch.utils.swap_tensors
    yield
    assert torch._C._len_torch_dispatch_stack() == before, "a dispatch mode leaked out of the test"
    assert torch.utils.swap_tensors is swap, "a guard was left open: swap_tensors is still wrapped"
    from kvguard._engine import choice as _choice

    leaked = [hook.name for hook in _choice._hook_engines.values() if hook.judges]
    for hook in _choice._hook_engines.values():  # so that one leak fails one test, not all after it
        for judge in list(hook.judges):
            hook.detach(judge)
    assert not leaked, f"a guard was left attached to the {', '.join(leaked)} engine"
