"""Plain records of detected mutations, with their plain and rich text, and the error and warning
that carry them. Stdlib only (rich when a panel is drawn); never holds a protected tensor."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, Optional, get_args

from kvguard._text import plural

# What an event found, one word each; `MutationEvent`'s docstring says what each means, and
# docs/reports.md's list is tested against this one (tests/test_docs.py).
EventKind = Literal["write", "metadata", "repoint", "unobserved", "version", "alias", "reduced_twice",
                    "self_overlap", "written_twice"]
EVENT_KINDS: tuple[EventKind, ...] = get_args(EventKind)
REDUCED_TWICE: EventKind = "reduced_twice"  # the kinds named in code elsewhere (kvguard._engine.judge finds them)
SELF_OVERLAP: EventKind = "self_overlap"
WRITTEN_TWICE: EventKind = "written_twice"  # kvguard._protect.weights_writers finds it, in a load of weights
# Reported even where the path is allowed (`allow=`), as only a `kvguard.allow` block allows
# them: the write is meant, how it lands is not.
REPORTED_WHEN_ALLOWED: frozenset[EventKind] = frozenset({"alias", REDUCED_TWICE, SELF_OVERLAP, WRITTEN_TWICE})

@dataclasses.dataclass(frozen=True)
class MutationEvent:
    """One in-place write to a protected tensor, as plain text and numbers.

    Example::

        ev.path       "rollout_data['kl'][0]"
        ev.op         "aten.mul_.Tensor"
        ev.kind       "write" | "metadata" | "repoint" | "unobserved" | "version" | "alias"
                      | "reduced_twice" | "self_overlap" | "written_twice"
                      ("version": a tensor autograd saved, whose version counter alone the write bumps;
                      "reduced_twice": a reduction reaching memory held under several paths a second time
                      at one line in one guarded call; "self_overlap": an op reading elements of the
                      memory it writes, shifted: `x[:, 1:].copy_(x[:, :-1])`; "written_twice": a weight
                      element written a second time within one load, overwriting what that load had
                      just loaded)
        ev.filename   "/src/loss.py";  ev.lineno 212;  ev.code "k *= kl_coef"
        ev.placed_at  "loss.py:201" (None when the tensor was there before the guard began)
    """

    path: str
    op: str
    kind: EventKind
    blocked: bool
    filename: str
    lineno: int
    code: str
    function: str
    placed_at: Optional[str]
    tensor: str
    before: str
    after: Optional[str]
    diff: str
    aliases: tuple[str, ...] = ()  # other paths to the same memory (the same tensor, or others the write reached)
    detached: bool = False  # removed from (or replaced in) the guarded object before the write
    # The fix, for a write stopped before it ran (empty: the general one, `HINT`); for any write made by a
    # well-known intended writer whose library version is outside the range it was read in, who wrote it
    hint: str = ""
    # For a change no op showed: when it was found, in the user's words ("at optimizer step 3, before
    # it ran"); empty: by a boundary check (guard exit, `g.check()`)
    found: str = ""
    # A write to a tensor autograd saved, made through a tensor with a version counter of its own
    # (`w.data.fill_(1)`): autograd's check at backward never sees it, and backward reads the new values.
    unversioned: bool = False

    @property
    def site(self) -> str:
        """`loss.py:212`, the short location used in messages."""
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    def headline(self) -> str:
        """One sentence naming who, what and where."""
        if self.kind == "unobserved":
            if self.found:
                return f"{self.path} changed, but no dispatched op wrote it (found {self.found}, {self.site})"
            return (
                f"{self.path} changed during the guard, but no dispatched op wrote it "
                f"(found by a boundary check, at guard exit or g.check(), {self.site})"
            )
        verb = "would be" if self.blocked else "was"
        if self.kind == "version":
            return (f"{self.path}'s version counter {verb} bumped by {self.op} at {self.site} "
                    "(no saved element changed)")
        what = {
            "write": "modified in place",
            "metadata": "reshaped in place (metadata only)",
            "repoint": "re-pointed to other memory",
            "alias": "modified in place through elements that share memory",
            REDUCED_TWICE: "reduced in place a second time",
            WRITTEN_TWICE: "written a second time in one load",
        }.get(self.kind, "modified in place")
        path = self.path
        if self.aliases:  # one memory under several paths: said in the first line, whatever the action
            path += f" (the same memory as {', '.join(self.aliases)})"
        if self.kind == SELF_OVERLAP:
            return f"{path} {verb} modified in place by {self.op}, which reads memory it writes, at {self.site}"
        return f"{path} {verb} {what} by {self.op} at {self.site}"

    def __str__(self) -> str:
        return self.headline()


@dataclasses.dataclass
class GuardReport:
    """Everything one guard saw: `ok`, `events` in write order, and `format()`.

    `events` keeps every write only under `action="record"` with `KVGUARD_MAX_EVENTS`
    unset; otherwise the first `KVGUARD_MAX_EVENTS` (default 100), and `cut` counts the
    rest. `allowed` counts intended writes by reason (`allow=PATTERN`, `kvguard.allow('...')`).
    """

    name: str
    action: str
    events: list[MutationEvent] = dataclasses.field(default_factory=list)
    cut: int = 0
    allowed: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no protected tensor was written (allowed writes do not count)."""
        return not self.events and not self.cut

    def format(self) -> str:
        """The report as plain text; the first line is one standalone sentence."""
        return format_report(self)

    def __str__(self) -> str:
        return self.format()

    def __rich__(self) -> Any:
        return rich_report(self)


SAVED_PREFIX = "<saved by "  # how a tensor autograd saved is named: "<saved by SigmoidBackward0: result>"
SAVED_WRITE = ("autograd saved this tensor for backward, which would raise 'modified by an inplace operation' "
               "after this write")
# `t.data = other` bumps no version counter: PyTorch raises nothing at backward, which reads the new memory.
SAVED_DATA = ("autograd saved this tensor for backward; `.data =` bumps no version counter, so PyTorch "
              "would read the new memory at backward and raise nothing")
SAVED_UNVERSIONED = ("autograd saved this tensor for backward; this write goes through a tensor with a version "
                     "counter of its own (`.data`), so PyTorch would read the new values at backward and raise nothing")
SAVED_COUNTER = ("no saved element changed, but this write bumps the version counter that autograd checks; "
                 "backward will raise 'modified by an inplace operation'")
MAX_EVENT_CHARS = 3000  # leaves room for a panel's frame and a rank tag under 4 KiB
MAX_VALUE_CHARS = 400  # one detail line of a panel
MAX_EVENTS_SHOWN = 20
HINT = "write to a new tensor (k = k * c) or clone first (k = k.clone())"


def event_details(ev: MutationEvent) -> list[tuple[str, str]]:
    """The aligned `key  value` lines under an event's headline."""
    rows = [("code", ev.code), ("tensor", ev.tensor)]
    if ev.aliases:
        rows.append(("also at", ", ".join(ev.aliases)))
    if ev.detached:
        rows.append(("note", "no longer in the guarded object; protected since it was there"))
    saved = ev.path.startswith(SAVED_PREFIX)
    if ev.placed_at:
        rows.append(("saved at" if saved else "placed", ev.placed_at))
    if saved:
        rows.append(("backward", SAVED_COUNTER if ev.kind == "version" else
                     SAVED_DATA if ev.op == "Tensor.data assignment" else
                     SAVED_UNVERSIONED if ev.unversioned else SAVED_WRITE))
    if ev.blocked and ev.kind in REPORTED_WHEN_ALLOWED:
        rows.append(("shared" if ev.kind == "alias" else "reduced" if ev.kind == REDUCED_TWICE else
                     "load" if ev.kind == WRITTEN_TWICE else "overlap", ev.diff))
    if ev.blocked:
        rows += [("values", ev.before), ("action", "raised before the write; the data is intact"),
                 ("hint", ev.hint or HINT)]
    elif ev.kind in ("write", "version", "alias", REDUCED_TWICE, SELF_OVERLAP, WRITTEN_TWICE):
        rows += [("before", ev.before), ("after", ev.after or ""), ("changed", ev.diff)]
    else:
        rows += [("before", ev.before), ("after", ev.after or ""), ("note", ev.diff)]
    if ev.hint and not ev.blocked:  # a write that ran: said only when there is more to say (a known writer)
        rows.append(("hint", ev.hint))
    return rows


def detail_line(key: str, value: str) -> str:
    """One aligned `  key      value` line of a plain-text event."""
    return f"  {key:<8} {value}"


def format_event(ev: MutationEvent) -> str:
    lines = [ev.headline()] + [detail_line(key, value) for key, value in event_details(ev)]
    return _clip("\n".join(lines))


def _clip_value(text: str) -> str:
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 2] + " …"


def format_report(report: GuardReport) -> str:
    if report.ok:
        return f"kvguard: no in-place writes to the tensors protected in {report.name}"
    shown = report.events[:MAX_EVENTS_SHOWN]
    blocks = [format_event(ev) for ev in shown]
    more = len(report.events) - len(shown) + report.cut
    if more:
        blocks.append(_more(more, report.cut))
    return "\n".join(blocks)


def _more(more: int, cut: int) -> str:
    text = f"… and {plural(more, 'more write')}"
    return text + (f" ({cut:,} past KVGUARD_MAX_EVENTS, counted only)" if cut else "")


def _clip(text: str) -> str:
    if len(text) <= MAX_EVENT_CHARS:
        return text
    return text[: MAX_EVENT_CHARS - 2] + " …"


def rich_event(ev: MutationEvent, tag: str = "") -> Any:
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, show_header=False, show_edge=False, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in event_details(ev):
        table.add_row(key, Text(_clip_value(value)))  # Text: user code is not rich markup
    title = "kvguard: in-place write blocked" if ev.blocked else "kvguard: in-place write"
    if tag:
        title += f"  {tag}"
    from rich.console import Group

    headline = Text(_clip_value(ev.headline()), style="bold red" if ev.blocked else "bold yellow")
    return Panel(Group(headline, table), title=title, title_align="left", expand=False)


def rich_report(report: GuardReport) -> Any:
    from rich.console import Group
    from rich.text import Text

    if report.ok:
        return Text(format_report(report), style="green")
    items = [rich_event(ev) for ev in report.events[:MAX_EVENTS_SHOWN]]
    more = len(report.events) - len(items) + report.cut
    if more:
        items.append(Text(_more(more, report.cut)))
    return Group(*items)


class MutationError(RuntimeError):
    """A protected tensor was (or was about to be) written in place.

    Raised before the write in `action="raise"`, so the data is intact. Carries the
    `event` that triggered it and the guard's `report`; both are plain data, so the
    error pickles across processes (Ray, multiprocessing).

    A handler that names this class (`except MutationError:`, `pytest.raises(
    MutationError)`; found from the bytecode when the error is raised, see `kvguard._guard.handlers`)
    or reads the error (its text, `event` or `report`) has seen it. One that catches it
    through a base class without looking (`except RuntimeError: retry`) swallowed it:
    the guard raises it again at its exit.
    """

    def __init__(self, message: str, event: Optional[MutationEvent] = None,
                 report: Optional[GuardReport] = None) -> None:
        super().__init__(message, event, report)
        # Shared with the guard that raised it, which keeps this cell, not the error (whose
        # traceback holds the writing frames), to tell at its exit whether it was read
        # (or caught by a handler that names this class).
        self.seen_cell = [False]

    @property
    def seen(self) -> bool:
        return self.seen_cell[0]

    @property
    def event(self) -> Optional[MutationEvent]:
        self.seen_cell[0] = True
        return self.args[1]  # type: ignore[no-any-return]

    @property
    def report(self) -> Optional[GuardReport]:
        self.seen_cell[0] = True
        return self.args[2]  # type: ignore[no-any-return]

    def __str__(self) -> str:
        self.seen_cell[0] = True
        return str(self.args[0])


class MutationWarning(UserWarning):
    """A protected tensor was written in place (`action="warn"`)."""
