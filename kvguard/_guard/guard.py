"""`guard()` and `Guard`: apply the action, own the report, run the boundary checks.

Its options are resolved in `options`, what it may protect and its name in `target`; the
`guarded` decorator is `calls`. Torch-free at import: the engine (`kvguard._engine`) and
the protected set (`kvguard._protect.protected`) load when a guard is entered.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys
import threading
import warnings
from typing import Any, Callable, Collection, Literal, Optional, TypeVar

from kvguard import _ranks
from kvguard._errors import GuardWarning
from kvguard._guard import handlers as _handlers
from kvguard._guard import options as _options
from kvguard._guard.allow import Allowlist
from kvguard._guard.allow import boundaries as allow_boundaries
from kvguard._guard.allow import said_by_target as allow_said
from kvguard._guard.target import caller_name, check_target
from kvguard._kinds import Kind
from kvguard._protect import frames as _frames
from kvguard._protect.contract import Protected
from kvguard._report.account import CallAccount
from kvguard._report import render as _render
from kvguard._report.events import (REPORTED_WHEN_ALLOWED, GuardReport, MutationError, MutationEvent, MutationWarning,
                                    detail_line, format_event)
from kvguard._report.process import PROCESS
from kvguard._text import say

F = TypeVar("F", bound=Callable[..., Any])


class Guard:
    """A context manager that protects every tensor reachable from `obj`.

    Use through `kvguard.guard(...)`. After (or during) the block, `g.report` holds what
    happened. A guard can be entered once.
    """

    # Whose well-known intended writers (`kvguard._intended`) it lets through: "weights", "autograd".
    intended_for: Optional[str] = None
    # The process-wide kind it is (`kvguard._kinds`), whose word it is counted under however it
    # was made; None: counted under its target, else its name (a kind's env guard passes its word).
    kind: Optional[Kind] = None

    def __init__(self, obj: Any, *, name: Optional[str] = None, action: Optional[str] = "raise",
                 keys: Optional[Collection[Any]] = None, ignore: Optional[Collection[Any]] = None,
                 allow: Optional[Collection[str]] = None, report_dir: Optional[str | os.PathLike[str]] = None,
                 target: Optional[str] = None, level: Optional[str] = None,
                 fingerprint: Optional[bool] = None) -> None:
        # Each option not given (None) is the `KVGUARD_*` setting, else the built-in default.
        self.options = _options.resolve(action, level, fingerprint, keys, ignore, allow, target, self.intended_for)
        check_target(obj)
        self.obj = obj
        self.name = name if name is not None else caller_name(obj)
        self.report = GuardReport(name=self.name, action=self.action)
        self._attachment: Any = None  # the engine's hold on this guard (see `kvguard._engine.choice`), level "full"
        self.engine: Optional[str] = None  # which engine finds its writes, once entered ("full" only)
        self._protected: Optional[Protected] = None
        self._entered = False
        # (seen cell, message, event) of each error raised in an op; unread ones are raised
        # again at exit. Not the errors: their tracebacks hold the writing frames.
        self._raised: list[tuple[list[bool], str, Optional[MutationEvent]]] = []
        self._checked = 0  # events already returned by `check()`
        self._unhook_repoints: Callable[[], None] = lambda: None
        self.target = target  # `module:qualname(arg)` when env activation guards a target
        # Where exit-check events are located; defaults to the frame that exits the guard
        # (integrations such as the pytest plugin point it at the test instead).
        self.exit_site: Optional[_frames.Site] = None
        # Warnings that a `-W error` filter turned into exceptions: never raised into the
        # user's code, kept for integrations (the pytest plugin fails the test with them).
        self.unraised_warnings: list[Warning] = []
        self.keys_seen: frozenset[Any] = frozenset()  # top-level keys the object held (set at exit)
        # its counts, once entered: a kind's under its word, from code or KVGUARD_TARGETS alike
        self._account = CallAccount(self.kind.word if self.kind is not None else target or self.name, report_dir)
        self.protected_count = 0  # tensors protected over the guard's life (set at exit)
        # Set at exit when the guarded code did nothing here and an integration says it does
        # not run in this process (`_ranks.register_not_run_check`): the call is then counted
        # as "not run here", not as a clean guarded call.
        self.not_run: Optional[str] = None
        self._said_never_matching: set[str] = set()  # `allow=` patterns said to match no path

    # The options as resolved (`options.Options`), read-only.
    @property
    def action(self) -> str:
        """"raise", "warn" or "record"."""
        return self.options.action

    @property
    def level(self) -> str:
        """"full" (every op, and the boundaries) or "light" (the boundaries only)."""
        return self.options.level

    @property
    def fingerprint(self) -> bool:
        """Whether values are compared by digest at the boundaries."""
        return self.options.fingerprint

    @property
    def keys(self) -> Optional[tuple[Any, ...]]:
        """The top-level keys protected; None: all."""
        return self.options.keys

    @property
    def ignore(self) -> tuple[Any, ...]:
        """The top-level keys never protected."""
        return self.options.ignore

    @property
    def allow(self) -> Allowlist:
        """The intended writes: `allow=` patterns (and `kvguard.allow` blocks, read as they run)."""
        return self.options.allow

    @property
    def report_dir(self) -> Optional[str]:
        """Where this guard's report files go, once entered (None: none)."""
        return self._account.report_dir

    @property
    def call(self) -> int:
        """This guard's number among the process's guarded calls, once entered."""
        return self._account.call

    def __enter__(self) -> Guard:
        if self._entered:
            raise RuntimeError("a kvguard.guard(...) can be entered once; create a new one")
        self._entered = True
        self._account.open()
        self._protected = self._new_protected()
        self._watch_ops()
        self.engine = self._attachment.engine if self._attachment is not None else None
        self._thread = threading.get_ident()
        allow_boundaries.append(self._allow_boundary)
        return self

    def _new_protected(self) -> Protected:
        """The protected set this guard judges writes against (`guard_autograd` has its own).

        Its tensors are kept in C++ (`NativeSet`) where the compiled extension serves this
        guard: with the compiled engine, or at the light level where it is loaded. The
        `kernels` and `mode` engines keep them in Python (`ProtectedSet`).
        """
        from kvguard._protect.native import NativeSet, table_module
        from kvguard._protect.protected import ProtectedSet

        if self.level == "full":
            from kvguard._engine import choice as _choice

            native = _choice.choose() == "compiled" and table_module() is not None  # choose() loads it
        else:
            native = table_module() is not None
        kind = NativeSet if native else ProtectedSet
        return kind(self.obj, self.name, self.keys, self.ignore, fingerprint=self.fingerprint)

    def _allow_boundary(self) -> None:
        """A `kvguard.allow` block begins or ends on this guard's thread: a boundary check then.

        What changed before the block is reported as usual; what changed inside it (a
        numpy write the exit check would find later) is allowed with the block's reason.
        """
        if self._protected is not None and threading.get_ident() == self._thread and not self._paused:
            self._boundary_check(rescan=False)

    def _step_aside(self, t1: Any, t2: Any) -> Callable[[bool], None]:
        """Light level: let `swap_tensors` run (it refuses weak references); a boundary check reports it."""
        assert self._protected is not None  # hooked only while entered
        restore = self._protected.release((t1, t2))
        return lambda swapped: restore()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if self._protected is None:
            raise RuntimeError(f"{self!r} exited without being entered")
        if self._allow_boundary in allow_boundaries:
            allow_boundaries.remove(self._allow_boundary)
        try:
            try:
                if self._attachment is not None:  # out of order, or on another thread's stack (then
                    self._attachment.detach((exc_type, exc, tb))  # inert once the set is closed)
            finally:
                self._unhook_repoints()
        finally:
            self._protected.final = True  # nothing is compared after this check
            # Sampled out, there is no baseline to compare with: the interval now is not checked.
            unobserved = self._exit_check() if not self._sampled_out else []
            if self._clock is not None:
                self._unfollow()
                self._account.sampled(self._clock.setting.every, *self._clock.counts())
            self.keys_seen = frozenset(self._protected.keys_seen)
            self.protected_count = self._protected.protected_count
            self.not_run = self._not_run_reason(exc_type, unobserved)
            self._account.close(self.protected_count, self.not_run, self._moments(),
                                self._protected.unprotected)
            self._protected.close()
            self._protected = self._attachment = None
            self.obj = None
        for event in unobserved:
            self._on_event(event, at_exit=True)
        if isinstance(exc, MutationError) and exc.args[2] is self.report:
            _frames.drop_internal_frames(exc)
        if exc_type is None and self.target is None and self.not_run is None:
            self._warn_if_blind()
        unread = next(((message, event) for seen, message, event in self._raised if not seen[0]), None)
        self._raised = []
        if exc_type is not None or self.action != "raise":
            return False  # an exception already leaving the block is never masked
        if unread is not None:
            # An `except RuntimeError:` around the write swallowed the error unread: the
            # write was skipped and the code went on as if it had happened. (A handler that
            # names MutationError marked it seen when it was raised: see `handlers`.)
            raise MutationError(unread[0] + "\n" + detail_line(
                "caught", "this MutationError was caught inside the guard and never read (by a handler "
                "for a broader class: except RuntimeError/Exception?); the write did not happen. A handler "
                "that expects it names kvguard.MutationError"), unread[1], self.report)
        if unobserved:
            # Too late to stop the change, but a raise guard must not end quietly.
            raise MutationError(format_event(unobserved[0]), unobserved[0], self.report)
        return False

    def _not_run_reason(self, exc_type: Any, unobserved: list[MutationEvent]) -> Optional[str]:
        """Why this call did not run in this process, or None when it ran (or may have).

        Asked of the integrations only for a call that left no trace: no exception, no
        finding, nothing allowed, and no op seen under the guard: no op at all for the
        `mode` engine, no writing op for the write hooks (they never see reads). Under
        level "light", where no op is seen, the integration's word decides.
        """
        if exc_type is not None or unobserved or self.report.events or self.report.cut or self._raised:
            return None
        if self.report.allowed or self._ops_seen():
            return None
        try:
            return _ranks.not_run_reason()
        except Exception:  # noqa: BLE001 - never fail a guard's exit over a count
            return None

    def _warn_if_blind(self) -> None:
        """A `GuardWarning` when the guard may have looked at nothing."""
        missing = [k for k in self.keys or () if k not in self.keys_seen]
        if missing:
            self._warn(f"kvguard.guard({self.name}, {self.options.keys_from}): {', '.join(map(repr, missing))} never appeared "
                       f"in {self.name} (it held {_key_list(self.keys_seen)}); nothing was protected under "
                       f"{'that name' if len(missing) == 1 else 'those names'}", GuardWarning)
        elif self.protected_count == 0:
            self._warn(f"kvguard.guard({self.name}) protected no tensor: {self.name} held none while the "
                       "guard was active, so no write could be checked", GuardWarning)

    def _warn(self, message: str, category: type[Warning], filename: Optional[str] = None,
              lineno: int = 0) -> None:
        """Warn without ever raising into the user's code (`-W error` must not kill the job)."""
        try:
            if filename is None:
                site = self.exit_site or _frames.user_site()
                filename, lineno = site.filename, site.lineno
            if category is MutationWarning:  # its panel is on stderr: no second display there
                with _render.panel_replaces_display(message, category):
                    warnings.warn_explicit(message, category, filename, lineno)
            else:
                warnings.warn_explicit(message, category, filename, lineno)
        except Exception as exc:  # noqa: BLE001 - a warnings filter set to "error", or a broken hook
            self.unraised_warnings.append(exc if isinstance(exc, Warning) else category(message))
            if category is not MutationWarning:  # a MutationWarning's panel is printed already
                say(f"kvguard: {message}")

    def check(self) -> list[MutationEvent]:
        """Run the boundary checks now; returns the events recorded since the last `check()`.

        Finds what no op reported (values changed through numpy, a raw pointer, another
        thread, a compiled kernel; memory re-pointed), each once. Under action="raise"
        the first such finding raises `MutationError` (the change has happened).
        """
        if self._protected is None:
            raise RuntimeError(f"{self!r}.check() needs an active guard (inside its `with` block)")
        try:
            self._boundary_check(rescan=True)
        finally:  # a raised finding is returned by no later check
            fresh, self._checked = self.report.events[self._checked:], len(self.report.events)
        return fresh

    def _boundary_check(self, rescan: bool) -> None:
        """Report what changed with no op reporting it; under raise the first finding raises.

        A finding inside an allowed block (or under an `allow=` pattern) is allowed instead.
        """
        found = self._exit_check(_frames.user_site(), rescan=rescan)
        for event in found:
            self._on_event(event, at_exit=True)
        if found and self.action == "raise":
            raise MutationError(format_event(found[0]), found[0], self.report)

    def _exit_check(self, site: Optional[_frames.Site] = None, rescan: bool = False) -> list[MutationEvent]:
        """Boundary findings as events: values or memory that changed with no op reporting it."""
        from kvguard._engine.judge import boundary_event

        if self._judge is not None:  # collectives whose wait() was not seen: their values as of now
            self._judge.settle_collectives("at the guard's boundary check (its exit, g.check() or a pause)")
        events = []
        assert self._protected is not None  # checked only while entered
        for change in self._protected.boundary_changes(sys._getframe(1), rescan):
            site = site or self.exit_site or _frames.user_site()
            event = boundary_event(change, site, watched_ops=self.level == "full")
            if not self._allowed(event):  # an allowed change is counted, never raised
                events.append(event)
        return events

    def _allowed(self, event: MutationEvent) -> bool:
        """Whether the write is intended (`allow=`, `kvguard.allow`); counted once it has happened.

        A write through shared elements (`kind="alias"`) is intended only inside a
        `kvguard.allow` block or a well-known intended writer (gradcheck perturbs an input
        whose `expand` was saved, and restores it): an allowed path or a user's scope names
        the elements a user meant to write, not the ones an `expand` made share them. So is a
        reduction reaching memory held under two paths a second time (`reduced_twice`) and an op
        reading memory it writes elsewhere (`self_overlap`): the write is meant, how it lands is not."""
        reached = functools.partial(self._tensors_at, event.path)  # asked only of a writer found running
        if event.kind in REPORTED_WHEN_ALLOWED:
            allowed = self.allow.block_reason() or self.allow.intended_reason(reached)
        else:
            allowed = self.allow.reason(event.path, reached)
        if allowed is None:
            return False
        if not event.blocked:
            self.report.allowed[allowed] = self.report.allowed.get(allowed, 0) + 1
            self._account.allowed(allowed)
        return True

    def _tensors_at(self, path: str) -> list[Any]:
        """The protected tensors at `path`: what a write reported there reaches (an intended writer
        found running must be meant to write them)."""
        protected = self._protected
        return protected.tensors_at(path) if protected is not None else []

    def _on_event(self, event: MutationEvent, at_exit: bool = False) -> None:
        if self._allowed(event):  # an intended write: it happens, counted once it has
            return
        hint = self.allow.unread_hint(functools.partial(self._tensors_at, event.path))
        if hint:  # a known writer, in a library version it was not read in: say so, not a stray write
            event = dataclasses.replace(event, hint=hint)
        said = allow_said.setdefault(self.target, set()) if self.target else self._said_never_matching
        never = self.allow.never_matching(event.path, self.name, said)
        if never is not None:  # an allow= the user thinks covers this write
            self._warn(f"kvguard.guard({self.name}): {never}", GuardWarning, event.filename, event.lineno)
        protected = self._protected  # None at exit: what it found then has no forward pass or step
        self._account.event(event, self._moments() if protected is not None else None)
        if self.options.keep is None or len(self.report.events) < self.options.keep:
            self.report.events.append(event)
        else:
            self.report.cut += 1
        PROCESS.publish(event, self)
        if self.action == "raise" and not at_exit:
            error = MutationError(format_event(event), event, self.report)
            if _handlers.caught_by_its_own_class(error, sys._getframe(1)):
                error.seen_cell[0] = True  # `except MutationError:`, `pytest.raises(MutationError)`: expected
            self._raised = [r for r in self._raised if not r[0][0]] + [(error.seen_cell, error.args[0], event)]
            raise error
        if self.action == "warn" and PROCESS.first_sighting(event):  # later writes at the site: counted
            _render.print_event(event, tag=_ranks.rank_tag())
            self._warn(event.headline(), MutationWarning, event.filename, event.lineno)

    def _moments(self) -> int:
        """The protected set's forward passes or optimizer steps so far (a kind's moments; 0 elsewhere);
        under the sampled tier, optimizer steps as the step clock counts them, checked or not."""
        protected = self._protected
        if protected is None:
            return 0
        if protected.steps and self._clock is not None:
            return int(self._clock.index)
        return int(protected.graphs or protected.steps)

    # -- pause and resume: a guarded generator's or coroutine's body between its steps ---------

    _paused = False  # set while the body is suspended: no op of anyone else's is judged
    _judge: Any = None  # the engine's judge of this guard's writes, kept over pauses (level "full")
    _ops_before = 0  # ops seen under the attachments of earlier stretches

    def pause(self, site: Optional[_frames.Site] = None) -> Optional[MutationError]:
        """Stop watching while a guarded generator or coroutine is suspended (`yield`, `await`).

        Detaches from the engine, so that writes made by other code on this thread (the
        consumer, other coroutines) until `resume()` are not this guard's, then checks the
        stretch that just ran as the exit check would: its findings are reported as at exit,
        located at `site` (where the body is suspended). Under action="raise" the error for
        the first finding is returned, for the caller to raise in the body (the change has
        happened); None otherwise.
        """
        if self._protected is None or self._paused:
            raise RuntimeError(f"{self!r}.pause() needs an active guard that is not paused")
        self._detach()
        found = self._exit_check(site)
        for event in found:
            self._on_event(event, at_exit=True)
        if found and self.action == "raise":
            return MutationError(format_event(found[0]), found[0], self.report)
        return None

    def _detach(self) -> None:
        """Stop watching ops (paused): the engine's hold and the repoint listeners let go."""
        self._paused = True
        attachment, self._attachment = self._attachment, None
        unhook, self._unhook_repoints = self._unhook_repoints, _nothing_to_undo
        try:
            if attachment is not None:
                self._ops_before += attachment.ops
                attachment.detach((None, None, None))
        finally:
            unhook()

    _sampled_out = False  # the sampled tier leaves the interval now unchecked
    _clock: Any = None  # the step clock it follows under KVGUARD_SAMPLE (`follow_sample`)

    def follow_sample(self, clock: Any) -> None:
        """Check only the intervals the sampled tier's step clock checks (`kvguard._guard.sampling`),
        from now to exit; the exit line says how many that was."""
        self._clock = clock
        self._unfollow = clock.listen(lambda checked: self.sample_in() if checked else self.sample_out())
        if not clock.checked:
            self.sample_out()

    def sample_out(self) -> None:
        """Stop watching as `pause()` does, with no check of the stretch (the interval that just
        ended was checked by the step that ended it); `sample_in()` starts again from the values then."""
        if self._protected is not None and not self._paused:
            self._detach()
            self._sampled_out = True

    def sample_in(self) -> None:
        """Watch again, from the values as they are: what changed while unchecked is not looked at."""
        if self._protected is not None and self._sampled_out:
            self._sampled_out = False
            self.resume()

    def resume(self) -> None:
        """Watch again as the body resumes, from the values and placements as they are now.

        What other code changed while the body was suspended is not the body's: the
        digests start again from the values now, without reporting it.
        """
        if self._protected is None or not self._paused:
            raise RuntimeError(f"{self!r}.resume() needs a paused guard")
        self._protected.boundary_changes(None, rescan=False)  # digests and placements as of now
        self._watch_ops()
        self._paused = False

    def _watch_ops(self) -> None:
        """Attach to the engine (level "full"), and watch `swap_tensors` and `.data =` (which no op
        shows; at level "light", step aside for `swap_tensors` only): at entry and each resume."""
        from kvguard._torch import patches as _patches

        if self.level != "full":  # no per-op hook at all; `swap_tensors` still needs our weak references aside
            self._unhook_repoints = _patches.on_swap_tensors(self._step_aside)
            return
        from kvguard._engine import choice as _choice
        from kvguard._engine.judge import WriteJudge

        if self._judge is None:
            assert self._protected is not None  # watched only while entered
            self._judge = WriteJudge(self._protected, self._on_event, block=self.action == "raise")
        unhook_swap = _patches.on_swap_tensors(self._judge.on_swap)
        unhook_data = _patches.on_data_assignment(self._judge.on_data)

        def unhook_repoints() -> None:
            unhook_data()
            unhook_swap()
        self._unhook_repoints = unhook_repoints
        try:
            self._attachment = _choice.attach(self._judge)
        except BaseException:
            self._unhook_repoints()
            self._unhook_repoints = _nothing_to_undo
            raise

    def _ops_seen(self) -> int:
        """Ops the engine saw under this guard, over every stretch it was attached."""
        return self._ops_before + (self._attachment.ops if self._attachment is not None else 0)

    def __repr__(self) -> str:
        state = "active" if self._protected is not None else ("done" if self._entered else "new")
        return f"<kvguard.guard {self.name} action={self.action} {state}, {len(self.report.events)} events>"


def _nothing_to_undo() -> None:
    pass


def guard(obj: Any, *, name: Optional[str] = None, action: str = "raise",
          keys: Optional[Collection[Any]] = None, ignore: Optional[Collection[Any]] = None,
          allow: Optional[Collection[str]] = None, report_dir: Optional[str | os.PathLike[str]] = None,
          level: Optional[str] = None, fingerprint: Optional[bool] = None) -> Guard:
    """Protect every tensor reachable from `obj` while the `with` block runs.

    An option left at None takes its `KVGUARD_*` variable (`KVGUARD_KEYS`,
    `KVGUARD_IGNORE`, `KVGUARD_ALLOW`, `KVGUARD_LEVEL`, `KVGUARD_FINGERPRINT`,
    `KVGUARD_REPORT_DIR`) when it is set, else the default below; an argument given here
    wins. A bad variable raises `ConfigError` naming it.

    Args:
        obj: a dict, list, tuple or tensor, nested at any depth. Tensors placed into its
            dicts and lists inside the block are protected from the moment they are placed.
        name: how paths start in reports (`rollout_data['kl'][0]`); defaults to the
            caller's variable name for `obj`.
        action: "raise" stops the write with `MutationError` before it happens; "warn"
            lets it happen and, for the first write at each site (line and op) in the
            process, warns and prints a report to stderr; "record" only fills `g.report`.
        keys: protect only these top-level keys (or indices); default: all.
        ignore: never protect these top-level keys (or indices); default: none.
        allow: paths whose writes are intended, as reports print them, `[*]` for any
            list index (`"rollout_data['advantages'][*]"`), or functions as
            `module:qualname` whose every write is intended while they run: they happen,
            even under "raise", and are counted in `g.report.allowed` instead of reported.
        report_dir: write report files here; default: none.
        level: "full" (the default) watches every op (attribution at the write, raise
            before it) and checks values at the boundaries (exit, `g.check()`); "light"
            only checks the boundaries: no per-op cost, no op attribution.
        fingerprint: compare each protected tensor's values (a digest taken when it is
            protected) at the boundaries; default: on.

    Example::

        with kvguard.guard(rollout_data, action="warn") as g:
            compute_advantages_and_returns(args, rollout_data)
        print(g.report.format())
    """
    return Guard(obj, name=name, action=action, keys=keys, ignore=ignore, allow=allow, report_dir=report_dir,
                 level=level, fingerprint=fingerprint)


def _key_list(keys: Collection[Any]) -> str:
    shown = sorted(map(repr, keys))
    return ", ".join(shown[:8]) + (f" … (+{len(shown) - 8})" if len(shown) > 8 else "") if shown else "no keys"
