"""A blocked write's `MutationError` caught by its own class is handled; one a broader handler drops is raised again.

Each program below is what a user writes around a write that a `raise` guard blocks. The
guard's exit then either stays quiet (the error was expected: a handler names
`kvguard.MutationError`, or read it) or raises it again with "caught inside the guard and
never read" (a handler for a broader class swallowed it). The handlers are read from the
bytecode on Python 3.11+ (`kvguard._guard.handlers`); on 3.10 only reading the error counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dis
import gc
import importlib.metadata
import pickle
import sys
import traceback
import types
import unittest
import weakref
from typing import Any, Callable

import pytest
import torch

import kvguard
from kvguard import MutationError
from kvguard._guard import handlers as _handlers

pytest_plugins = ["pytester"]

NEVER_READ = "caught inside the guard and never read"
HAS_TABLE = sys.version_info >= (3, 11)
ENGINES = ("compiled", "kernels", "mode")
Rd = dict[str, torch.Tensor]


def write(rd: Rd) -> None:
    rd["k"].add_(1)


# -- own class: handled ---------------------------------------------------------------------

def except_own(rd: Rd) -> None:
    try:
        write(rd)
    except MutationError:
        pass


def except_own_in_a_tuple(rd: Rd) -> None:
    try:
        write(rd)
    except (ValueError, kvguard.MutationError):
        pass


def pytest_raises(rd: Rd) -> None:
    with pytest.raises(kvguard.MutationError):
        rd["k"].add_(1)


def pytest_raises_call_form(rd: Rd) -> None:
    pytest.raises(MutationError, rd["k"].add_, 1)


def suppress_own(rd: Rd) -> None:
    with contextlib.suppress(MutationError):
        write(rd)


class _Case(unittest.TestCase):
    def runTest(self) -> None:
        pass


def assert_raises(rd: Rd) -> None:
    with _Case().assertRaises(MutationError):
        write(rd)


def assert_raises_call_form(rd: Rd) -> None:
    _Case().assertRaises(MutationError, write, rd)


def nested_inner_other_class(rd: Rd) -> None:
    try:
        try:
            write(rd)
        except (ValueError, KeyError):  # not its class: Python tries the outer handler
            pass
    except MutationError:
        pass


def second_clause(rd: Rd) -> None:
    try:
        write(rd)
    except ValueError:
        pass
    except MutationError:
        pass


def helper_frame(rd: Rd) -> None:
    def deep(rd: Rd) -> None:
        write(rd)  # two frames between the handler and the write

    try:
        deep(rd)
    except MutationError:
        pass


def reraise_to_an_own_handler(rd: Rd) -> None:
    try:
        try:
            write(rd)
        except MutationError as err:
            raise err
    except MutationError:
        pass


def broad_reraise_inside_pytest_raises(rd: Rd) -> None:
    with pytest.raises(MutationError):
        try:
            write(rd)
        except Exception:  # logs and re-raises: not the handler that decides
            raise


def finally_that_passes_it_on(rd: Rd) -> None:
    def step(rd: Rd) -> None:
        try:
            write(rd)
        finally:
            rd["seen"] = torch.zeros(1)

    with pytest.raises(MutationError):
        step(rd)


def other_managers_in_between(rd: Rd) -> None:
    with pytest.raises(MutationError):
        with torch.no_grad(), contextlib.nullcontext(rd), kvguard.guard({"other": torch.zeros(1)}):
            write(rd)


def augmented_assignment(rd: Rd) -> None:
    k = rd["k"]
    with pytest.raises(MutationError):
        k *= 2


def in_a_generator(rd: Rd) -> None:
    def steps() -> Any:
        yield 1
        write(rd)

    try:
        list(steps())
    except MutationError:
        pass


def in_a_lambda(rd: Rd) -> None:
    with pytest.raises(MutationError):
        (lambda: write(rd))()


_ALIAS = MutationError


def local_alias(rd: Rd) -> None:
    expected = _ALIAS
    try:
        write(rd)
    except expected:
        pass


def in_a_coroutine(rd: Rd) -> None:
    async def inner() -> None:
        write(rd)

    async def outer() -> None:
        try:
            await inner()
        except MutationError:
            pass

    asyncio.run(outer())


class MyMutationError(MutationError):
    """A subclass: `except MyMutationError` does not catch a plain MutationError."""


def subclass_handler_does_not_match(rd: Rd) -> None:
    try:
        try:
            write(rd)
        except MyMutationError:
            pass
    except MutationError:
        pass


# -- a broader class: raised again at exit -------------------------------------------------

def except_runtime_error(rd: Rd) -> None:
    try:
        write(rd)
    except RuntimeError:
        pass


def except_exception(rd: Rd) -> None:
    try:
        write(rd)
    except Exception:
        pass


def bare_except(rd: Rd) -> None:
    try:
        write(rd)
    except:  # noqa: E722
        pass


def pytest_raises_runtime_error(rd: Rd) -> None:
    with pytest.raises(RuntimeError):
        write(rd)


def suppress_exception(rd: Rd) -> None:
    with contextlib.suppress(Exception):
        write(rd)


def broad_inner_before_own_outer(rd: Rd) -> None:
    try:
        try:
            write(rd)
        except RuntimeError:  # this one runs: the outer handler never sees the error
            pass
    except MutationError:
        pass


def broad_handler_in_a_helper(rd: Rd) -> None:
    def retry(rd: Rd) -> None:
        try:
            write(rd)
        except Exception:
            pass

    try:
        retry(rd)
    except MutationError:
        pass


def own_reraise_into_a_broad_handler(rd: Rd) -> None:
    try:
        try:
            write(rd)
        except MutationError:
            raise
    except RuntimeError:
        pass


def finally_that_returns(rd: Rd) -> None:
    def step(rd: Rd) -> int:
        try:
            write(rd)
        finally:
            return 1  # noqa: B012 - swallows the error

    step(rd)


def finally_that_continues(rd: Rd) -> None:
    for _ in range(2):
        try:
            write(rd)
        finally:
            continue  # noqa: B012


def tuple_of_bases(rd: Rd) -> None:
    try:
        write(rd)
    except (KeyError, RuntimeError):
        pass


HANDLED = [except_own, except_own_in_a_tuple, pytest_raises, pytest_raises_call_form, suppress_own,
           assert_raises, assert_raises_call_form, nested_inner_other_class, second_clause, helper_frame,
           reraise_to_an_own_handler, broad_reraise_inside_pytest_raises, finally_that_passes_it_on,
           other_managers_in_between, augmented_assignment, in_a_generator, in_a_lambda, local_alias,
           in_a_coroutine, subclass_handler_does_not_match]
SWALLOWED = [except_runtime_error, except_exception, bare_except, pytest_raises_runtime_error,
             suppress_exception, broad_inner_before_own_outer, broad_handler_in_a_helper,
             own_reraise_into_a_broad_handler, finally_that_returns, finally_that_continues, tuple_of_bases]


def guarded_run(program: Callable[[Rd], None]) -> tuple[Rd, kvguard.Guard]:
    rd = {"k": torch.ones(3)}
    with kvguard.guard(rd, name="rd") as g:
        program(rd)
    return rd, g


@pytest.mark.skipif(not HAS_TABLE, reason="Python 3.10 has no exception table: only reading the error counts")
@pytest.mark.parametrize("program", HANDLED, ids=lambda f: f.__name__)
def test_an_error_caught_by_its_own_class_is_handled(program: Callable[[Rd], None]) -> None:
    rd, g = guarded_run(program)
    assert torch.equal(rd["k"], torch.ones(3))  # blocked, not re-raised
    assert g.report.events and g.report.events[0].blocked


@pytest.mark.parametrize("program", SWALLOWED, ids=lambda f: f.__name__)
def test_an_error_a_broader_handler_swallows_is_raised_again(program: Callable[[Rd], None]) -> None:
    with pytest.raises(MutationError, match=NEVER_READ) as excinfo:
        guarded_run(program)
    assert excinfo.value.event is not None and excinfo.value.event.path == "rd['k']"
    assert "names kvguard.MutationError" in str(excinfo.value)


@pytest.mark.skipif(not HAS_TABLE, reason="Python 3.10 has no exception table")
@pytest.mark.parametrize("engine", ENGINES, indirect=True)
@pytest.mark.parametrize("program", [pytest_raises, helper_frame, except_runtime_error, own_reraise_into_a_broad_handler],
                         ids=lambda f: f.__name__)
def test_the_frames_between_write_and_handler_under_each_engine(engine: str, program: Callable[[Rd], None]) -> None:
    """Each engine raises from different frames (a C++ hook, torch's kernels, a dispatch mode)."""
    if program in SWALLOWED:
        with pytest.raises(MutationError, match=NEVER_READ):
            guarded_run(program)
    else:
        guarded_run(program)


def test_an_error_leaving_the_guard_is_never_masked() -> None:
    rd = {"k": torch.ones(3)}
    with pytest.raises(MutationError) as excinfo:
        with kvguard.guard(rd, name="rd"):
            try:
                write(rd)
            except MutationError:
                raise
    assert NEVER_READ not in str(excinfo.value)


def test_the_guard_keeps_its_old_rule_where_the_bytecode_cannot_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on Python 3.10 (no exception table): an unread error is raised again, a read one is not."""
    monkeypatch.setattr(_handlers, "_decode", lambda code: None)
    with pytest.raises(MutationError, match=NEVER_READ):
        guarded_run(except_own)

    def reads(rd: Rd) -> None:
        try:
            write(rd)
        except MutationError as err:
            assert "rd['k']" in str(err)

    guarded_run(reads)


def test_an_analysis_that_fails_answers_not_handled(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(error: BaseException, frame: Any) -> str:
        raise IndexError("unexpected bytecode")

    monkeypatch.setattr(_handlers, "_walk", broken)
    with pytest.raises(MutationError, match=NEVER_READ):
        guarded_run(pytest_raises)


@pytest.mark.skipif(not HAS_TABLE, reason="Python 3.10 has no exception table")
def test_reading_the_frames_names_keeps_no_local_alive() -> None:
    """`except expected:` with a local `expected` reads the frame's locals; a tensor deleted
    later in that function must be freed at once (no snapshot of the locals left behind)."""
    rd = {"k": torch.ones(3)}
    big = torch.ones(1000)
    freed = weakref.ref(big)
    expected = MutationError
    with kvguard.guard(rd, name="rd"):
        try:
            write(rd)
        except expected:
            pass
    del big
    assert freed() is None


@pytest.mark.skipif(not HAS_TABLE, reason="Python 3.10 has no exception table")
def test_our_exception_table_reader_agrees_with_dis() -> None:
    codes = _all_code(dis) + _all_code(contextlib) + _all_code(asyncio.tasks) + _all_code(sys.modules[__name__])
    assert len(codes) > 100
    for code in codes:
        ours = [tuple(e) for e in _handlers.parse_exception_table(code.co_exceptiontable)]
        theirs = [(e.start, e.end, e.target) for e in dis._parse_exception_table(code)]  # type: ignore[attr-defined]
        assert ours == theirs, code


def _all_code(module: types.ModuleType) -> list[types.CodeType]:
    found: list[types.CodeType] = []
    pending = [v.__code__ for v in vars(module).values() if isinstance(v, types.FunctionType)]
    pending += [f.__code__ for cls in vars(module).values() if isinstance(cls, type)
                for f in vars(cls).values() if isinstance(f, types.FunctionType)]
    while pending:
        code = pending.pop()
        found.append(code)
        pending += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return found


def test_the_decoded_code_cache_keeps_no_code_object_alive() -> None:
    """A function whose handlers were read is freed with its code once it goes (Dynamo's
    transformed code among them: on torch 2.14 one kept until exit failed its clean-up hook)."""
    namespace: dict[str, Any] = {}
    exec(compile("def program(rd):\n    try:\n        rd['k'].add_(1)\n    except Exception:\n        pass\n",
                 "<program>", "exec"), namespace)
    code = weakref.ref(namespace["program"].__code__)
    with pytest.raises(MutationError):
        guarded_run(namespace["program"])
    assert code() in _handlers._decoded  # read: the broad handler swallowed it, so it was raised again
    namespace.clear()
    gc.collect()
    assert code() is None


def test_the_decoded_code_cache_stays_bounded() -> None:
    for i in range(_handlers._CACHE_SIZE + 50):
        _handlers._decode(compile(f"x = {i}", f"<gen {i}>", "exec"))
    assert len(_handlers._decoded) <= _handlers._CACHE_SIZE


# -- the error itself --------------------------------------------------------------------------

def test_the_error_still_pickles_and_prints_as_kvguard_mutation_error() -> None:
    rd = {"k": torch.ones(3)}
    with pytest.raises(MutationError) as excinfo:
        with kvguard.guard(rd, name="rd"):
            write(rd)
    copy = pickle.loads(pickle.dumps(excinfo.value))
    assert type(copy) is MutationError and copy.event.path == "rd['k']"
    # Python prints an uncaught one by its module and name (test_never_crash runs that uncaught).
    (line,) = traceback.format_exception_only(excinfo.value)
    assert line.startswith("kvguard.MutationError: rd['k'] would be modified in place by aten.add_.Tensor"), line


# -- in a pytest run: pytest.raises around a blocked write -------------------------------------

PLUGIN_TESTS = """
import contextlib, pytest, torch, kvguard

@pytest.fixture
def batch():
    return {"kl": [torch.ones(4)]}

def test_expects_the_block(mutation_guard, batch):
    mutation_guard.protect(batch, name="batch")
    with pytest.raises(kvguard.MutationError):
        batch["kl"][0].add_(1)
    assert torch.equal(batch["kl"][0], torch.ones(4))

@pytest.mark.kvguard(arg="batch")
def test_marker_expects_the_block(batch):
    with contextlib.suppress(kvguard.MutationError):
        batch["kl"][0].add_(1)

def test_swallows_the_block(mutation_guard, batch):
    mutation_guard.protect(batch, name="batch")
    with pytest.raises(RuntimeError):
        batch["kl"][0].add_(1)
"""


def test_pytest_raises_of_its_class_passes_a_broader_one_fails(pytester: pytest.Pytester) -> None:
    installed = any(ep.name == "kvguard" for ep in importlib.metadata.entry_points(group="pytest11"))
    pytester.makepyfile(test_blocks=PLUGIN_TESTS)
    result = pytester.runpytest("--disable-plugin-autoload", "-p", "kvguard" if installed else "kvguard._activate.pytest_plugin")
    result.assert_outcomes(passed=2, failed=1)
    text = result.stdout.str()
    assert "batch['kl'][0] would be modified in place by aten.add_.Tensor at test_blocks.py:21" in text, text
    assert NEVER_READ in text and "FAILED test_blocks.py::test_swallows_the_block" in text, text
