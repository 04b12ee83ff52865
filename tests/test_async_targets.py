"""Generators, coroutines and async generators under a guard: `kvguard.guarded` and env targets.

The guard is active while the body runs and paused while it is suspended: what other
coroutines, or the consumer, write in between is theirs. In-process cases run under
every engine; env activation runs in fresh interpreters.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Iterator

import pytest
import torch

import kvguard
from kvguard._report.process import PROCESS

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("compiled", "kernels", "mode")


@pytest.fixture(params=ENGINES)
def each_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test under each engine (as tests/conftest.py does for the per-engine modules)."""
    from kvguard._engine import choice as _choice
    from kvguard._protect import records as _records

    why = _choice.why_not(request.param)
    if why is not None:
        if os.environ.get("CI") and request.param == "compiled":
            pytest.fail(f"the compiled engine is not available under CI: {why}")
        pytest.skip(f"the {request.param} engine is not available here: {why}")
    monkeypatch.setenv("KVGUARD_ENGINE", request.param)
    if request.param != "compiled":
        monkeypatch.setattr(_records, "compiled_describe", lambda: None)
    return str(request.param)


def rollout() -> dict[str, Any]:
    return {"kl": [torch.zeros(3)], "adv": torch.ones(3)}


def where(report: kvguard.GuardReport) -> list[tuple[str, str, str]]:
    return [(e.path, e.op, e.code) for e in report.events]


# -- the forms are kept ----------------------------------------------------------------------

def test_each_form_stays_its_own_kind() -> None:
    async def coro(rd: Any) -> int:
        return 1

    def gen(rd: Any) -> Iterator[int]:
        yield 1

    async def agen(rd: Any) -> AsyncIterator[int]:
        yield 1

    def plain(rd: Any) -> int:
        return 1

    wrapped = [kvguard.guarded("rd")(f) for f in (coro, gen, agen, plain)]
    assert inspect.iscoroutinefunction(wrapped[0]) and not inspect.isgeneratorfunction(wrapped[0])
    assert inspect.isgeneratorfunction(wrapped[1]) and inspect.isasyncgenfunction(wrapped[2])
    assert not any(check(wrapped[3]) for check in (inspect.iscoroutinefunction, inspect.isgeneratorfunction,
                                                    inspect.isasyncgenfunction))
    assert [w.__name__ for w in wrapped] == ["coro", "gen", "agen", "plain"]
    assert str(inspect.signature(wrapped[0])) == "(rd: 'Any') -> 'int'"


def test_the_repro_in_process(each_engine: str) -> None:
    @kvguard.guarded("rollout_data")
    async def acompute(rollout_data: Any) -> None:
        rollout_data["kl"][0].add_(1)

    @kvguard.guarded("rollout_data")
    def gen(rollout_data: Any) -> Iterator[int]:
        rollout_data["kl"][0].add_(1)
        yield 1

    rd = rollout()
    with pytest.raises(kvguard.MutationError, match=r"rollout_data\['kl'\]\[0\] would be modified"):
        asyncio.run(acompute(rd))
    with pytest.raises(kvguard.MutationError, match=r"rollout_data\['kl'\]\[0\] would be modified"):
        list(gen(rd))
    assert torch.equal(rd["kl"][0], torch.zeros(3)), "raise stops the write inside the body"


def test_a_blocked_write_raises_at_the_writing_line_and_the_traceback_ends_there(each_engine: str) -> None:
    @kvguard.guarded("rd")
    async def acompute(rd: Any) -> None:
        await asyncio.sleep(0)
        rd["kl"][0].mul_(2)  # the writing line

    @kvguard.guarded("rd")
    def gen(rd: Any) -> Iterator[int]:
        yield 0
        rd["kl"][0].mul_(2)  # the writing line
        yield 1

    for run in (lambda: asyncio.run(acompute(rollout())), lambda: list(gen(rollout()))):
        with pytest.raises(kvguard.MutationError) as info:
            run()
        frames = traceback.extract_tb(info.value.__traceback__)
        assert frames[-1].line == 'rd["kl"][0].mul_(2)  # the writing line'
        assert not [f.filename for f in frames if f"{os.sep}kvguard{os.sep}" in f.filename
                    or f"{os.sep}torch{os.sep}" in f.filename]


def test_writes_in_a_body_between_suspensions_are_reported_at_their_lines(each_engine: str) -> None:
    @kvguard.guarded("rd", action="record")
    async def acompute(rd: Any) -> int:
        rd["kl"][0].add_(1)
        await asyncio.sleep(0)
        rd["adv"].mul_(2)
        return 7

    rd = rollout()
    assert asyncio.run(acompute(rd)) == 7
    assert where(acompute.last_report) == [("rd['kl'][0]", "aten.add_.Tensor", 'rd["kl"][0].add_(1)'),
                                           ("rd['adv']", "aten.mul_.Tensor", 'rd["adv"].mul_(2)')]


# -- interleaving: nothing of anyone else's is a coroutine's own -------------------------------

def test_two_coroutines_of_one_function_interleaved_where_only_one_writes(each_engine: str) -> None:
    reports: dict[bool, kvguard.GuardReport] = {}

    @kvguard.guarded("rd", action="record")
    async def step(rd: Any, write: bool) -> bool:
        reports[write] = step.last_report  # this call's report: its guard was made just now
        for _ in range(3):
            await asyncio.sleep(0)  # hands the loop to the other coroutine
            if write:
                rd["kl"][0].add_(1)
        return write

    async def main() -> list[bool]:
        return list(await asyncio.gather(step(rd, False), step(rd, True), step(rd, False)))

    rd = rollout()
    assert asyncio.run(main()) == [False, True, False]
    assert where(reports[True]) == [("rd['kl'][0]", "aten.add_.Tensor", 'rd["kl"][0].add_(1)')] * 3
    assert reports[False].events == [] and reports[False].ok


def test_interleaved_coroutines_under_raise_stop_only_the_writer(each_engine: str) -> None:
    @kvguard.guarded("rd")
    async def step(rd: Any, write: bool) -> str:
        await asyncio.sleep(0)
        if write:
            rd["kl"][0].add_(1)
        await asyncio.sleep(0)
        return "done"

    async def main() -> list[Any]:
        return list(await asyncio.gather(step(rd, False), step(rd, True), return_exceptions=True))

    rd = rollout()
    clean, writer = asyncio.run(main())
    assert clean == "done" and isinstance(writer, kvguard.MutationError)
    assert torch.equal(rd["kl"][0], torch.zeros(3))


def test_the_consumer_writing_between_yields_is_not_the_generators_write(each_engine: str) -> None:
    @kvguard.guarded("rd", action="record")
    def gen(rd: Any) -> Iterator[int]:
        for i in range(3):
            rd["kl"][0].add_(1)  # the generator's own write
            yield i

    rd = rollout()
    for _ in gen(rd):
        rd["kl"][0].mul_(2)  # the consumer's write, by an op
        rd["kl"][0].numpy()[1] = 5.0  # and one no op sees
    assert where(gen.last_report) == [
        ("rd['kl'][0]", "aten.add_.Tensor", 'rd["kl"][0].add_(1)  # the generator\'s own write')] * 3


def test_a_change_no_op_sees_inside_the_body_is_found_at_the_next_suspension(each_engine: str) -> None:
    @kvguard.guarded("rd", action="record")
    def gen(rd: Any) -> Iterator[int]:
        yield 0
        rd["kl"][0].numpy()[0] = 3.0
        yield 1  # found here
        yield 2

    rd = rollout()
    assert list(gen(rd)) == [0, 1, 2]
    [event] = gen.last_report.events
    assert (event.op, event.code) == ("(no dispatched op)", "yield 1  # found here")


def test_under_raise_a_change_found_at_a_suspension_is_raised_in_the_body(each_engine: str) -> None:
    seen: list[str] = []

    @kvguard.guarded("rd")
    def gen(rd: Any) -> Iterator[int]:
        rd["kl"][0].numpy()[0] = 3.0
        try:
            yield 1
        except kvguard.MutationError as exc:
            seen.append(exc.event.op)
            raise

    with pytest.raises(kvguard.MutationError, match="changed"):
        list(gen(rollout()))
    assert seen == ["(no dispatched op)"]


# -- finishing: returned, raised, closed, abandoned -------------------------------------------

def test_a_generator_abandoned_half_way_is_checked_and_let_go(each_engine: str) -> None:
    @kvguard.guarded("rd", action="record")
    def gen(rd: Any) -> Iterator[int]:
        try:
            for i in range(10):
                yield i
        finally:
            rd["adv"].add_(1)  # runs at close: still the generator's own

    rd = rollout()
    calls = PROCESS.tally.calls
    it = gen(rd)
    assert next(it) == 0 and next(it) == 1
    rd["kl"][0].add_(5)  # the consumer's, while it is suspended
    del it
    gc.collect()
    assert PROCESS.tally.calls == calls + 1
    assert where(gen.last_report) == [("rd['adv']", "aten.add_.Tensor", 'rd["adv"].add_(1)  # runs at close: '
                                       "still the generator's own")]
    rd["adv"].add_(1)  # no longer guarded: the conftest also checks that no guard is left attached


def test_a_generator_never_started_guards_nothing_and_counts_no_call() -> None:
    @kvguard.guarded("rd", action="record")
    def gen(rd: Any) -> Iterator[int]:
        yield 1

    calls = PROCESS.tally.calls
    it = gen(rollout())
    del it
    gc.collect()
    assert PROCESS.tally.calls == calls and gen.last_report is None


def test_exceptions_thrown_in_reach_the_body_and_the_guard_goes_on(each_engine: str) -> None:
    @kvguard.guarded("rd", action="record")
    def gen(rd: Any) -> Iterator[str]:
        while True:
            try:
                yield "ready"
            except ValueError:
                rd["kl"][0].add_(1)
                yield "caught"
            except KeyError:
                return

    rd = rollout()
    it = gen(rd)
    assert next(it) == "ready"
    assert it.throw(ValueError("x")) == "caught"
    assert next(it) == "ready"
    with pytest.raises(StopIteration):
        it.throw(KeyError("stop"))
    assert where(gen.last_report) == [("rd['kl'][0]", "aten.add_.Tensor", 'rd["kl"][0].add_(1)')]


def test_a_cancelled_coroutine_is_checked_and_let_go(each_engine: str) -> None:
    @kvguard.guarded("rd", action="record")
    async def slow(rd: Any) -> None:
        rd["kl"][0].add_(1)
        await asyncio.sleep(10)

    async def main() -> None:
        task = asyncio.ensure_future(slow(rd))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    rd = rollout()
    asyncio.run(main())
    assert where(slow.last_report) == [("rd['kl'][0]", "aten.add_.Tensor", 'rd["kl"][0].add_(1)')]


def test_an_async_generator_with_asend_athrow_and_aclose(each_engine: str) -> None:
    @kvguard.guarded("rd", action="record")
    async def agen(rd: Any) -> AsyncIterator[Any]:
        got = None
        try:
            while True:
                await asyncio.sleep(0)
                try:
                    got = yield got
                except ValueError:
                    rd["kl"][0].add_(1)
                    got = "thrown"
        finally:
            rd["adv"].add_(1)  # at aclose

    async def main() -> list[Any]:
        it = agen(rd)
        out = [await it.asend(None), await it.asend("a")]
        rd["kl"][0].mul_(3)  # the consumer's
        out.append(await it.athrow(ValueError()))
        await it.aclose()
        return out

    rd = rollout()
    assert asyncio.run(main()) == [None, "a", "thrown"]
    assert [e.code for e in agen.last_report.events] == ['rd["kl"][0].add_(1)', 'rd["adv"].add_(1)  # at aclose']


def test_two_async_generators_interleaved(each_engine: str) -> None:
    reports: dict[bool, kvguard.GuardReport] = {}

    @kvguard.guarded("rd", action="record")
    async def agen(rd: Any, write: bool) -> AsyncIterator[int]:
        reports[write] = agen.last_report
        for i in range(3):
            await asyncio.sleep(0)
            if write:
                rd["kl"][0].add_(1)
            yield i

    async def drain(write: bool) -> list[int]:
        return [i async for i in agen(rd, write)]

    async def main() -> Any:
        return await asyncio.gather(drain(True), drain(False))

    rd = rollout()
    assert asyncio.run(main()) == [[0, 1, 2], [0, 1, 2]]
    assert len(reports[True].events) == 3 and reports[False].events == []


# -- delegation and wrappers ------------------------------------------------------------------

def test_yield_from_and_await_of_other_guarded_functions(each_engine: str) -> None:
    @kvguard.guarded("rd", action="record")
    def inner(rd: Any) -> Iterator[int]:
        rd["kl"][0].add_(1)
        yield 1

    @kvguard.guarded("rd", action="record")
    def outer(rd: Any) -> Iterator[int]:
        yield from inner(rd)
        yield 2

    @kvguard.guarded("rd", action="record")
    async def ainner(rd: Any) -> int:
        await asyncio.sleep(0)
        rd["adv"].add_(1)
        return 3

    @kvguard.guarded("rd", action="record")
    async def aouter(rd: Any) -> int:
        return await ainner(rd) + 1

    rd = rollout()
    assert list(outer(rd)) == [1, 2]
    assert where(inner.last_report) == where(outer.last_report) == [
        ("rd['kl'][0]", "aten.add_.Tensor", 'rd["kl"][0].add_(1)')]
    assert asyncio.run(aouter(rd)) == 4
    assert where(ainner.last_report) == where(aouter.last_report) == [
        ("rd['adv']", "aten.add_.Tensor", 'rd["adv"].add_(1)')]


async def _unguarded_step(rd: Any) -> str:
    await asyncio.sleep(0)
    rd["kl"][0].add_(1)
    return "stepped"


def _unguarded_rows(rd: Any) -> Iterator[int]:
    rd["adv"].add_(1)
    yield 1


def test_a_plain_function_returning_a_coroutine_or_generator_guards_it_to_its_end(each_engine: str) -> None:
    @kvguard.guarded("rd", action="record")
    def step(rd: Any) -> Awaitable[str]:
        return _unguarded_step(rd)  # a sync wrapper around an async function

    @kvguard.guarded("rd", action="record")
    def rows(rd: Any) -> Iterator[int]:
        return _unguarded_rows(rd)

    rd = rollout()
    assert asyncio.run(step(rd)) == "stepped"  # type: ignore[arg-type]
    assert where(step.last_report) == [("rd['kl'][0]", "aten.add_.Tensor", 'rd["kl"][0].add_(1)')]
    assert list(rows(rd)) == [1]
    assert where(rows.last_report) == [("rd['adv']", "aten.add_.Tensor", 'rd["adv"].add_(1)')]
    calls = PROCESS.tally.calls
    dropped = rows(rd)  # never iterated: its guard is closed when it goes
    del dropped
    gc.collect()
    assert PROCESS.tally.calls == calls + 1 and rows.last_report.ok


def test_a_plain_function_returning_a_task_says_that_the_task_is_not_guarded(capsys: Any) -> None:
    @kvguard.guarded("rd", action="record")
    def schedule(rd: Any) -> Any:
        return asyncio.ensure_future(_unguarded_step(rd))

    async def main() -> None:
        await schedule(rd)
        await schedule(rd)

    rd = rollout()
    asyncio.run(main())
    lines = [line for line in capsys.readouterr().err.splitlines() if "kvguard:" in line]
    assert lines == ["kvguard: kvguard.guarded('rd'): test_a_plain_function_returning_a_task_says_that_the_task_"
                     "is_not_guarded.<locals>.schedule() returned an asyncio.Task, which runs after the call "
                     "returns: the guard covered only the call (guard the function that does the work)"]


def test_the_argument_left_at_its_default_runs_unguarded_in_every_form() -> None:
    @kvguard.guarded("rd")
    def gen(x: int, rd: Any = None) -> Iterator[int]:
        yield x

    @kvguard.guarded("rd")
    async def coro(x: int, rd: Any = None) -> int:
        return x

    assert list(gen(1)) == [1] and asyncio.run(coro(2)) == 2 and gen.last_report is None


# -- cost -------------------------------------------------------------------------------------

def test_a_generator_yielding_many_times_costs_about_a_guard_entry_and_exit_per_yield() -> None:
    """Each suspension checks the stretch that ran and each resume reads the values again:
    about one guard entry and exit per yield, never more than a few times that."""
    rd = {"kl": [torch.zeros(8) for _ in range(16)]}
    yields = 300

    def rows(rd: Any, n: int) -> Iterator[int]:
        yield from range(n)

    def one(rd: Any) -> None:
        pass

    guarded_rows, guarded_one = kvguard.guarded("rd", action="record")(rows), kvguard.guarded(
        "rd", action="record")(one)
    sum(guarded_rows(rd, 10))
    guarded_one(rd)
    best_yield = best_call = float("inf")
    for _ in range(3):  # side by side, the best of three: load slows both alike
        start = time.perf_counter()
        sum(guarded_rows(rd, yields))
        best_yield = min(best_yield, (time.perf_counter() - start) / yields)
        start = time.perf_counter()
        for _ in range(yields):
            guarded_one(rd)
        best_call = min(best_call, (time.perf_counter() - start) / yields)
    print(f"per yield {best_yield * 1e6:.0f} us, per guarded call {best_call * 1e6:.0f} us")
    assert best_yield < 4 * best_call


# -- env activation, in fresh interpreters ----------------------------------------------------

def run_job(tmp_path: Path, job: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    full_env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", COLUMNS="120", **env)
    (tmp_path / "job.py").write_text(textwrap.dedent(job))
    code = "import kvguard._activate.startup as s; s.activate(); import runpy; runpy.run_path('job.py', run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=full_env, capture_output=True,
                            text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def write_myrl(tmp_path: Path) -> None:
    (tmp_path / "myrl").mkdir()
    (tmp_path / "myrl" / "__init__.py").write_text("")
    (tmp_path / "myrl" / "loss.py").write_text(textwrap.dedent("""\
        import asyncio
        async def acompute(rollout_data): rollout_data["kl"][0].add_(1)
        def gen(rollout_data): rollout_data["kl"][0].add_(1); yield 1
        async def agen(rollout_data):
            await asyncio.sleep(0)
            rollout_data["kl"][0].mul_(2)
            yield 1
        async def quiet(rollout_data):
            await asyncio.sleep(0)
            return 1
    """))


TARGETS = ",".join(f"myrl.loss:{name}(rollout_data)" for name in ("acompute", "gen", "agen", "quiet"))


def test_the_repro_as_env_targets(tmp_path: Path) -> None:
    write_myrl(tmp_path)
    result = run_job(tmp_path, """
        import asyncio, inspect, torch
        from myrl.loss import acompute, gen, agen, quiet
        import kvguard
        rd = {"kl": [torch.zeros(2)]}
        assert inspect.iscoroutinefunction(acompute) and inspect.isasyncgenfunction(agen)
        async def drain():
            return [x async for x in agen(rd)]
        for run in (lambda: asyncio.run(acompute(rd)), lambda: list(gen(rd)), lambda: asyncio.run(drain())):
            try:
                run()
                print("ran")
            except kvguard.MutationError as exc:
                print("blocked", exc.event.code)
        print(asyncio.run(quiet(rd)), rd["kl"][0].tolist())
        from kvguard._report.process import PROCESS
        print({label.split(":")[1]: stats.calls for label, stats in PROCESS.tally.targets.items()},
              "writes", PROCESS.tally.writes)
    """, KVGUARD="raise", KVGUARD_TARGETS=TARGETS)
    assert result.stdout.splitlines() == [
        'blocked async def acompute(rollout_data): rollout_data["kl"][0].add_(1)',
        'blocked def gen(rollout_data): rollout_data["kl"][0].add_(1); yield 1',
        'blocked rollout_data["kl"][0].mul_(2)',
        "1 [0.0, 0.0]",
        "{'acompute(rollout_data)': 1, 'gen(rollout_data)': 1, 'agen(rollout_data)': 1, "
        "'quiet(rollout_data)': 1} writes 3",
    ]
    assert "no in-place writes" not in result.stderr.splitlines()[0]


def test_an_env_target_coroutine_interleaved_with_itself(tmp_path: Path) -> None:
    write_myrl(tmp_path)
    (tmp_path / "myrl" / "steps.py").write_text(textwrap.dedent("""\
        import asyncio
        async def step(rollout_data, write):
            for _ in range(3):
                await asyncio.sleep(0)
                if write:
                    rollout_data["kl"][0].add_(1)
    """))
    result = run_job(tmp_path, """
        import asyncio, torch
        from myrl.steps import step
        from kvguard._report.process import PROCESS
        rd = {"kl": [torch.zeros(2)]}
        async def main():
            await asyncio.gather(step(rd, False), step(rd, True), step(rd, False))
        asyncio.run(main())
        print("calls", PROCESS.tally.calls, "writes", PROCESS.tally.writes)
    """, KVGUARD="record", KVGUARD_TARGETS="myrl.steps:step(rollout_data)")
    assert "calls 3 writes 3" in result.stdout


def test_an_uncaught_error_from_an_env_target_ends_at_the_writing_line(tmp_path: Path) -> None:
    write_myrl(tmp_path)
    (tmp_path / "myrl" / "plain.py").write_text("def compute(rollout_data):\n    rollout_data['kl'][0].add_(1)\n")
    for call in ("compute(rd)", "list(gen(rd))", "asyncio.run(acompute(rd))"):
        result = run_job(tmp_path, f"""
            import asyncio, torch
            from myrl.loss import acompute, gen
            from myrl.plain import compute
            rd = {{"kl": [torch.zeros(2)]}}
            {call}
        """, check=False, KVGUARD="raise", KVGUARD_TARGETS=TARGETS + ",myrl.plain:compute(rollout_data)")
        trace = result.stderr.split("kvguard.MutationError")[0]
        files = [line.split('"')[1] for line in trace.splitlines() if line.startswith('  File "')]
        assert files and files[-1].endswith(os.path.join("myrl", "plain.py") if "compute(" in call[:8]
                                            else os.path.join("myrl", "loss.py")), trace
        assert not [f for f in files if f"{os.sep}kvguard{os.sep}" in f or f"{os.sep}torch{os.sep}" in f], trace
