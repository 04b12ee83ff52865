"""One call wrapper for `guarded` and env targets: bind the argument, guard the call's body.

The wrapper has the form of the function it wraps (`inspect.iscoroutinefunction` and
the like, and asyncio, see what they expect):

- a plain function runs under the guard; one that returns a generator or a coroutine
  (a plain `def` around an `async def`) keeps its guard until that object finishes;
- a generator, coroutine or async generator function is guarded while its body runs:
  the guard is paused at each suspension (`yield`, or an `await` that hands control to
  the event loop) and resumed at each `send` / `__next__` / `throw` / `asend` / `athrow`,
  so what other coroutines on the same thread write in between is theirs, not its own.
  Each pause checks the stretch that just ran; each resume starts from the values then.
  The exit check runs when the body returns, raises, or is closed (`close()`,
  garbage collection) unfinished.

Torch-free at import: the guard itself is made by the caller's `start`.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import types
from typing import (Any, AsyncGenerator, Callable, Collection, Coroutine, Final, Generator, Literal, Optional, Protocol,
                    TypeVar, cast)

from kvguard._config import check_action, guard_defaults, parse_level
from kvguard._report.events import MutationError
from kvguard._guard import sampling as _sampling
from kvguard._guard.guard import Guard
from kvguard._protect import frames as _frames
from kvguard._report import files as _reportfile
from kvguard._text import did_you_mean, say

F = TypeVar("F", bound=Callable[..., object])
MISSING: Final = object()  # the argument was not passed (left at its default), or the call cannot bind
# The guard for one call: `start(value, arguments)` gets the argument's value (MISSING when
# not passed) and the call's bound arguments; None runs the call unguarded.
Start = Callable[[object, dict[str, object]], Optional[Guard]]
Finish = Callable[[Guard], None]  # after the guard of a call has exited


def parameters(fn: Callable[..., object], argname: str) -> inspect.Signature:
    """`fn`'s signature; a `TypeError` naming its parameters when it has no `argname`."""
    signature = inspect.signature(fn)
    if argname not in signature.parameters:
        raise TypeError(f"{getattr(fn, '__qualname__', fn)}() has no parameter {argname!r}; "
                        f"its parameters are {', '.join(signature.parameters) or 'none'}"
                        f"{did_you_mean(argname, signature.parameters)}")
    return signature


def wrap(fn: F, argname: str, start: Start, who: str, finish: Optional[Finish] = None) -> F:
    """A wrapper of `fn`'s own form that guards `argname` on each call (see the module docstring).

    `who` names the wrapper in messages (`kvguard.guarded('rd')`, `target m:f(rd)`).
    Marked for Dynamo to step around it (`kvguard._torch.compiled.outside_dynamo`).
    """
    try:
        signature = parameters(fn, argname)
    except TypeError as exc:
        raise TypeError(f"{who}: {exc}") from None

    def guard_for(args: tuple[object, ...], kwargs: dict[str, object]) -> Optional[Guard]:
        try:
            arguments = dict(signature.bind_partial(*args, **kwargs).arguments)
        except TypeError:  # the call itself reports the bad arguments
            return start(MISSING, {})
        return start(arguments.get(argname, MISSING), arguments)

    done = finish if finish is not None else _nothing
    if inspect.isasyncgenfunction(fn):
        wrapper: Callable[..., object] = _async_generator_wrapper(fn, guard_for, done)
    elif inspect.iscoroutinefunction(fn):
        wrapper = _coroutine_wrapper(fn, guard_for, done)
    elif inspect.isgeneratorfunction(fn):
        wrapper = _generator_wrapper(fn, guard_for, done)
    else:
        wrapper = _plain_wrapper(fn, guard_for, done, who)
    from kvguard._torch.compiled import outside_dynamo  # imports torch, as the code it wraps does

    return cast(F, outside_dynamo(functools.wraps(fn)(wrapper)))  # a wrapper of `fn`'s form


def guarded(argname: str, *, name: Optional[str] = None, action: str = "raise",
            keys: Optional[Collection[object]] = None, ignore: Optional[Collection[object]] = None,
            allow: Optional[Collection[str]] = None, report_dir: Optional[str | os.PathLike[str]] = None,
            level: Optional[str] = None, fingerprint: Optional[bool] = None) -> Callable[[F], F]:
    """Decorator: guard the argument `argname` on every call of the function.

    Options as for `guard()` (None: the `KVGUARD_*` setting, else the default). The last
    call's report is kept on the wrapper as `fn.last_report`. Generator, coroutine and
    async generator functions are guarded while their body runs, paused whenever it is
    suspended (see `calls`); the wrapper has the same form, for `asyncio` and `inspect`.

    Example::

        @kvguard.guarded("rollout_data", action="warn")
        def compute_advantages_and_returns(args, rollout_data): ...
    """
    check_action(action, "kvguard.guarded(action=...)")
    if level is not None:
        parse_level(level, "kvguard.guarded(level=...)")
    if not isinstance(argname, str):
        raise TypeError(f"kvguard.guarded() takes the argument's name as a string, got {argname!r}")

    def decorate(fn: F) -> F:
        numbers = itertools.count(1)

        def start(value: object, arguments: dict[str, object]) -> Optional[Guard]:
            if value is MISSING:
                return None  # left at its default: nothing of the caller's to protect
            if not _calls_selected(next(numbers), name or argname):
                return None
            # Passed as given: an option left at None is the KVGUARD_* setting, else the default.
            g = Guard(value, name=name or argname, action=action, keys=keys, ignore=ignore, allow=allow,
                      report_dir=report_dir, level=level, fingerprint=fingerprint)
            outer.last_report = g.report  # type: ignore[attr-defined]
            return g

        outer = wrap(fn, argname, start, f"kvguard.guarded({argname!r})")
        outer.last_report = None  # type: ignore[attr-defined]
        return outer

    return decorate


def _calls_selected(number: int, label: str) -> bool:
    """Whether `KVGUARD_CALLS` (as for env targets) selects call `number` of a `guarded` function.

    A call it leaves out runs unguarded and is counted as such in the summaries.
    """
    selection = guard_defaults().calls
    if selection is not None and not selection.selects(number):
        for stats in _reportfile.target_tallies(label):
            stats.unguarded_calls += 1
        return False
    return sampled(number, label)


def sampled(number: int, label: str) -> bool:
    """Whether the sampled tier (`KVGUARD_SAMPLE`) checks call `number` (from 1) of `label`; a call
    it leaves out runs unguarded and is counted as such (`unsampled_calls`)."""
    setting = _sampling.sample()
    if _sampling.checks(setting, label, number - 1):
        return True
    for stats in _reportfile.target_tallies(label):
        stats.unsampled_calls += 1
        stats.sample_every = setting.every
    return False


def _nothing(guard: Guard) -> None:
    pass


GuardFor = Callable[[tuple[object, ...], dict[str, object]], Optional[Guard]]


def _plain_wrapper(fn: Callable[..., object], guard_for: GuardFor, done: Finish, who: str) -> Callable[..., object]:
    said: list[str] = []

    def call(*args: object, **kwargs: object) -> object:
        g = guard_for(args, kwargs)
        if g is None:
            return fn(*args, **kwargs)
        runner = _run(g, fn, args, kwargs, done)
        try:
            result = runner.send(None)
        except StopIteration as stop:
            return _said_unguarded(stop.value, fn, who, said)
        except MutationError as exc:
            _frames.drop_internal_frames(exc)
            raise
        return _continued(runner, result)
    return call


def _run(g: Guard, fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object],
         done: Finish) -> Generator[object, object, object]:
    """Call `fn` under `g`; a generator or coroutine it returns keeps the guard (yielded, then driven)."""
    with _Running(g, done):
        result = fn(*args, **kwargs)
        steps = _steps_of(result)
        if steps is None:
            return result
        error = g.pause()  # the plain body's stretch, checked at its return
        if error is not None:
            raise error
        try:
            yield result  # handed to the caller inside `_continued`, which drives the rest
        finally:  # also when it is dropped before it ran (closed by the collector)
            g.resume()
        return (yield from _drive(g, steps, result))


def _steps_of(result: object) -> Optional[_Steps]:
    """What to step through to run `result` to its end, for a generator or coroutine; else None."""
    if inspect.isgenerator(result):
        return result
    if inspect.iscoroutine(result):
        return result.__await__()
    return None


def _continued(runner: Generator[object, object, object], result: Any) -> object:
    """An object of `result`'s kind (a generator or a coroutine: named as it is) that runs `result`
    through `runner` (so under its guard)."""
    continued: Any = _awaited(runner) if inspect.iscoroutine(result) else _yielded_from(runner)
    continued.__name__, continued.__qualname__ = result.__name__, result.__qualname__
    return continued


def _yielded_from(runner: Generator[object, object, object]) -> Generator[object, object, object]:
    return (yield from runner)


async def _awaited(runner: Generator[object, object, object]) -> object:
    return await _as_awaitable(runner)


@types.coroutine
def _as_awaitable(runner: Generator[object, object, object]) -> Generator[object, object, object]:
    return (yield from runner)


def _said_unguarded(result: object, fn: Callable[..., object], who: str, said: list[str]) -> object:
    """`result`; once per function, a line when it is work that runs later, unguarded (a Task, an
    async generator): the guard covered only the call that made it."""
    if not said and (inspect.isasyncgen(result) or inspect.isawaitable(result)):
        said.append(who)
        say(f"kvguard: {who}: {getattr(fn, '__qualname__', fn)}() returned {_kind(result)}, which runs "
            "after the call returns: the guard covered only the call (guard the function that does the work)")
    return result


def _kind(value: object) -> str:
    """`an asyncio.Task`: the type with its public module (`_asyncio` is where `asyncio.Task` lives)."""
    kind = type(value)
    module = kind.__module__.lstrip("_")
    name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _generator_wrapper(fn: Callable[..., Generator[object, object, object]], guard_for: GuardFor,
                       done: Finish) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> Generator[object, object, object]:
        g = guard_for(args, kwargs)
        if g is None:
            return (yield from fn(*args, **kwargs))
        body = fn(*args, **kwargs)
        with _Running(g, done):
            return (yield from _drive(g, body, body))
    return call


def _coroutine_wrapper(fn: Callable[..., Coroutine[object, object, object]], guard_for: GuardFor,
                       done: Finish) -> Callable[..., object]:
    async def call(*args: object, **kwargs: object) -> object:
        g = guard_for(args, kwargs)
        body = fn(*args, **kwargs)
        steps = _steps_of(body)
        if g is None or steps is None:
            return await body  # not guarded, or not a coroutine: `await` says what it is
        with _Running(g, done):
            return await _drive(g, steps, body)
    return call


def _async_generator_wrapper(fn: Callable[..., AsyncGenerator[object, object]], guard_for: GuardFor,
                             done: Finish) -> Callable[..., object]:
    async def call(*args: object, **kwargs: object) -> AsyncGenerator[object, object]:
        g = guard_for(args, kwargs)
        body = fn(*args, **kwargs)
        with _Running(g, done) as guard:
            error: Optional[BaseException]
            value, error = None, None
            while True:
                step = body.asend(value) if error is None else body.athrow(error)
                try:
                    item = await _drive(guard, step, body)
                except StopAsyncIteration:
                    return
                error = guard.pause(_suspended_at(body))  # at its `yield`
                if error is None:
                    try:
                        value = yield item
                    except GeneratorExit:
                        guard.resume()
                        await _drive(guard, body.aclose(), body)
                        raise
                    except BaseException as exc:  # noqa: BLE001 - thrown in by the consumer: passed on
                        value, error = None, exc
                guard.resume()
    return call


class _Pausable(Protocol):
    """A `Guard`, or `_UNGUARDED` standing in for one."""

    def pause(self, site: Optional[_frames.Site] = None) -> Optional[MutationError]: ...

    def resume(self) -> None: ...


class _Steps(Protocol):
    """What `_drive` steps: a generator, a coroutine's `__await__()`, an async generator's
    `asend()`/`athrow()`/`aclose()` step."""

    def send(self, value: Any, /) -> object: ...  # Any: `__await__()` is typed to take only None

    def throw(self, error: BaseException, /) -> object: ...

    def close(self) -> object: ...


@types.coroutine
def _drive(g: _Pausable, steps: _Steps, body: object) -> Generator[object, object, object]:
    """`yield from steps` with `g` paused while `body` is suspended; returns what `steps` returns.

    `steps` is a generator, a coroutine's `__await__()` or an async generator's `asend()`
    step; `body` is the generator, coroutine or async generator whose frame says where it
    is suspended. A change found at a suspension under action="raise" is raised in the
    body, at the line where it is suspended. `g` is active when this returns or raises.
    """
    error: Optional[BaseException]
    value, error = None, None
    while True:
        try:
            out = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        error = g.pause(_suspended_at(body))
        if error is None:
            try:
                value = yield out
            except GeneratorExit:
                g.resume()
                steps.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown in by the caller: passed on
                value, error = None, exc
        g.resume()


def _suspended_at(body: object) -> Optional[_frames.Site]:
    """The line where a generator, coroutine or async generator is suspended, if it is."""
    frame = getattr(body, "gi_frame", None) or getattr(body, "cr_frame", None) or getattr(body, "ag_frame", None)
    return _frames.site_of(frame) if frame is not None else None


class _Running:
    """The frame around a guarded body: the guard entered, a `MutationError`'s traceback
    trimmed to the user's frames, `done` called however the body ends.

    A class, not `contextlib.contextmanager`: on 3.11 that sets `__traceback__` back to
    the untrimmed one after its generator re-raises. With no guard (the call runs
    unguarded), the body is still stepped, through `_UNGUARDED`.
    """

    def __init__(self, g: Optional[Guard], done: Finish) -> None:
        self.g, self.done = g, done

    def __enter__(self) -> _Pausable:
        if self.g is None:
            return _UNGUARDED
        try:
            return self.g.__enter__()
        except BaseException as error:
            if isinstance(error, MutationError):
                _frames.drop_internal_frames(error)
            self.done(self.g)
            raise

    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[types.TracebackType]) -> Literal[False]:  # never swallows: a guard's never does
        if self.g is None:
            return False
        try:
            return self.g.__exit__(kind, exc, tb)
        except MutationError as error:  # found at the exit check
            _frames.drop_internal_frames(error)
            raise
        finally:
            if isinstance(exc, MutationError):  # raised at the op, in the body
                _frames.drop_internal_frames(exc)
            self.done(self.g)


class _Unguarded:
    """Stands in for a guard where a call runs unguarded but its wrapper must still step it."""

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass

    def pause(self, site: Optional[_frames.Site] = None) -> None:
        return None

    def resume(self) -> None:
        pass


_UNGUARDED = _Unguarded()
