"""Render events and reports: plain text for errors, files and tests; rich for terminals.

Stdlib only at import; rich is imported when a panel is drawn. Every rendering of one
event stays under 4 KiB, so a single write of it is atomic on a pipe shared by ranks.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Optional, TextIO

from kvguard._report.events import (  # the plain and rich text of events lives with them
    MutationEvent, _clip_value, format_event, rich_event)
from kvguard._kinds import kind_of
from kvguard._report.tally import display_label
from kvguard._text import plural

if TYPE_CHECKING:
    from rich.table import Table

MAX_WRITE_BYTES = 4000  # a pipe write up to PIPE_BUF (4 KiB) is atomic on Linux


def print_event(ev: MutationEvent, tag: str = "", file: Optional[TextIO] = None) -> None:
    """Render one event once and write it to stderr in a single call.

    Best effort: the event is already in the report, so a missing (`sys.stderr` is None),
    closed or broken stream, or a rendering failure, drops the panel rather than the job.
    """
    out = file if file is not None else sys.stderr
    if out is None:
        return
    try:
        out.write(_panel_text(ev, tag, out))
        out.flush()
    except Exception:  # noqa: BLE001 - printing must never stop the user's op
        pass


def _panel_text(ev: MutationEvent, tag: str, out: TextIO) -> str:
    """The rich panel, or plain text when the panel would not fit one atomic write."""
    from rich.console import Console

    buffer = io.StringIO()
    isatty = bool(getattr(out, "isatty", lambda: False)())
    console = Console(file=buffer, width=_width(out), force_terminal=isatty,
                      color_system="auto" if isatty else None, soft_wrap=False)
    console.print(rich_event(ev, tag))
    text = buffer.getvalue()
    if len(text.encode()) > MAX_WRITE_BYTES:  # too big for one atomic write: plain text
        text = (f"kvguard [{tag}]: " if tag else "kvguard: ") + format_event(ev) + "\n"
        raw = text.encode()[: MAX_WRITE_BYTES - 8]
        text = raw.decode(errors="ignore") + (" …\n" if len(raw) < len(text.encode()) else "")
    return text


def _width(out: TextIO) -> int:
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit():
        return max(60, min(160, int(columns)))
    try:
        return max(60, min(160, os.get_terminal_size(out.fileno()).columns))
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return 100


def run_report(run: dict[str, Any], width: Optional[int] = None) -> str:
    """One run of `kvguard report` (`_reportread.describe`): a headline, a table, notes."""
    ranks = run["ranks"]
    who = plural(len(ranks), "rank") if ranks else plural(run["processes"], "process", "processes")
    head = f"kvguard: run {run['run']} ({who}): {plural(run['calls'], 'guarded call')}, "
    if run["protected"]:
        head += f"{plural(run['protected'], 'tensor')} protected, "
    if run["status"] == "clean":
        head += "clean: no in-place writes to protected tensors"
    elif run["by"] == "event":
        head += f"{run['events_in_files']:,} of {plural(run['writes'], 'write')} in the files, by event"
    else:
        head += f"{plural(run['writes'], 'write')} at {plural(run['sites'], 'site')}"
    lines = [head] + [f"  {_target_line(row)}" for row in run.get("targets", ()) if row["calls"] or row["writes"]]
    if run["rows"]:
        lines.append(_site_table(run["rows"], width) if run["by"] == "site" else _event_table(run["rows"], width))
    lines += [f"  allowed: {plural(count, 'write')} by {reason}" for reason, count in run["allowed"].items()]
    if run["unguarded_calls"]:
        lines.append(f"  note: {plural(run['unguarded_calls'], 'call')} left unguarded by KVGUARD_CALLS")
    lines += [f"  note: {note}" for note in run["notes"]]
    return "\n".join(lines)


def _target_line(row: dict[str, Any]) -> str:
    """`m:f(rollout_data): 24 guarded calls, 1,344 tensors protected, no in-place writes`, across processes."""
    kind = kind_of(row["target"])
    if kind is not None:  # one guard per process: passes or steps, not calls
        line = f"{row['target']}: " + kind.watched(row["protected"], row.get("moments") or 0)
        if row.get("sample_every"):  # never read as a full run's
            line += (f" (sampled 1 in {row['sample_every']:,}: {row['intervals_checked']:,} of "
                     f"{plural(row['intervals_seen'], 'step interval')} checked)")
        if row["writes"] is not None:
            line += (f", {plural(row['writes'], 'write')}" if row["writes"] else
                     ", no in-place writes to them" if row.get("unprotected") else ", no in-place writes")
        if row.get("unprotected"):  # never said clean: some of what autograd saved was not looked at
            line += f"; {row['unprotected']:,} unprotected under other saved-tensor hooks: not looked at"
        return line
    line = f"{display_label(row['target'])}: {plural(row['calls'], 'guarded call')}"
    if row.get("unsampled_calls"):
        line += f" ({row['unsampled_calls']:,} more not checked: sampled 1 in {row['sample_every']:,})"
    if row["calls"]:
        line += f", {plural(row['protected'], 'tensor')} protected"
    if row["writes"] is not None:
        line += f", {plural(row['writes'], 'write')}" if row["writes"] else ", no in-place writes"
    return line


def _site_table(rows: list[dict[str, Any]], width: Optional[int]) -> str:
    from rich.table import Table
    from rich.text import Text

    ranked = any(row["ranks"] for row in rows)
    table = Table()
    columns = ["site", "path", "writes"] + (["ranks"] if ranked else []) + ["first write"]
    # A path is read whole (it is what users grep and paste): the columns that start with one
    # are as wide as the longest, up to 40 characters and to what the width leaves after the
    # others' narrowest (a site's longest word, writes 10, ranks 8; 3 characters of rule each).
    width = width or _report_width(sys.stdout) or _UNBOUNDED
    site = max((len(word) for row in rows for word in f"{row['site']} {row['op']}".split()), default=0)
    room = (width - 3 * len(columns) - 1 - min(site, 30) - 10 - (8 if ranked else 0)) // 2
    longest = max((len(str(path)) for row in rows for path in (*row["paths"], row["first"].get("path"))),
                  default=0)
    for column in columns:
        table.add_column(column, overflow="fold", justify="right" if column == "writes" else "left",
                         min_width=max(1, min(longest, 40, room)) if column in ("path", "first write") else None)
    for row in rows:
        action = ("blocked" if row["blocked"] == row["writes"] else "happened" if not row["blocked"]
                  else f"{row['blocked']:,} blocked")
        first = row["first"]
        where = f"call {first.get('call')}" + (f", rank {first['rank']}" if len(row["ranks"]) > 1 else "")
        table.add_row(Text(f"{row['site']} {row['op']}\n{row.get('code') or ''}"), Text(", ".join(row["paths"])),
                      f"{row['writes']:,}\nin {plural(row['calls'], 'call')}\n{action}",
                      *([_ranges(row["ranks"])] if ranked else []),
                      Text(_clip_value(f"{first.get('path')}\n{where}: {(first.get('diff') or '').split(';')[0]}")))
    return _table_text(table, width)


def _event_table(rows: list[dict[str, Any]], width: Optional[int]) -> str:
    from rich.table import Table
    from rich.text import Text

    ranks = sorted({rank for row in rows for rank in row["counts"]},
                   key=lambda r: int(r) if r.lstrip("-").isdigit() else 1 << 30)  # JSON keys: "0", "None"
    table = Table(title_justify="left")
    for column in ("path", "op", "site", "code"):
        table.add_column(column, overflow="fold")
    for rank in ranks:
        table.add_column(f"rank {rank}" if rank != "None" else "writes", justify="right")
    for row in rows:
        table.add_row(*(Text(str(row[k] or "")) for k in ("path", "op", "site", "code")),
                      *(str(row["counts"].get(rank, "")) for rank in ranks))
    return _table_text(table, width)


def _table_text(table: Table, width: Optional[int]) -> str:
    """The table as plain text, `width` wide; else as wide as the terminal, or (in a pipe, a CI
    log) as its contents: cropped at a guessed width, a path or a diff would be cut mid-word."""
    from rich.console import Console

    width = width or _report_width(sys.stdout)
    if width is None:
        width = Console(file=io.StringIO(), width=_UNBOUNDED).measure(table).maximum
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    console.print(table)
    return buffer.getvalue().rstrip("\n")


_UNBOUNDED = 10_000  # a table's width when nothing bounds it: as wide as its contents


def _report_width(out: TextIO) -> Optional[int]:
    """`kvguard report`'s width: `COLUMNS`, else the terminal's; None when `out` is no terminal."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit():
        return max(60, int(columns))
    try:
        return max(60, os.get_terminal_size(out.fileno()).columns) if out.isatty() else None
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return None


def _ranges(ranks: list[int]) -> str:
    """`0-3, 5` from sorted rank numbers."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


@contextlib.contextmanager
def panel_replaces_display(message: str, category: type[Warning]) -> Iterator[None]:
    """Inside: Python's default display of this one warning is skipped (its panel was printed).

    Only the default display, to stderr with nobody listening, repeats the panel's first
    line. Whoever listens still gets the warning: filters (`-W error` makes it an
    exception, `ignore` drops it), `warnings.catch_warnings(record=True)` and pytest's
    capture (they replace the display), a custom `warnings.showwarning` (logging's
    `captureWarnings`). Other warnings shown meanwhile (another thread) are displayed.
    """
    shown = getattr(warnings, "_showwarnmsg_impl", None)
    if not _is_default_display(shown):
        yield
        return
    assert shown is not None

    def display(msg: warnings.WarningMessage) -> None:
        if not (isinstance(msg.message, category) and str(msg.message) == message):
            shown(msg)

    setattr(warnings, "_showwarnmsg_impl", display)
    try:
        yield
    finally:
        if getattr(warnings, "_showwarnmsg_impl", None) is display:
            setattr(warnings, "_showwarnmsg_impl", shown)


def _is_default_display(shown: object) -> bool:
    """Whether warnings go to Python's own stderr display (no capture, no custom showwarning)."""
    original = getattr(warnings, "_showwarning_orig", None)
    return (original is not None and warnings.showwarning is original and callable(shown)
            and getattr(shown, "__name__", "") == "_showwarnmsg_impl"
            and getattr(shown, "__module__", "") in ("warnings", "_py_warnings"))
