"""What guards saw, as counts: calls per target, writes per site, allowed writes. Stdlib only.

A site is a code location and an op (`loss.py:775 aten.mul_.Tensor`). One line of code
that writes a protected tensor in a loop over 256 samples and 10 calls is one finding:
it is counted per site, with its first example kept, so a process's tally stays as small
as its number of sites however long the job runs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from kvguard._kinds import KINDS, kind_of
from kvguard._paths import collapse
from kvguard._text import plural

if TYPE_CHECKING:
    from kvguard._report.events import MutationEvent

SiteKey = tuple[str, int, str]  # (filename, lineno, op)
# Event kinds a site's exit line counts by name (the others are its writes): how each is said.
SAID_KINDS = {"reduced_twice": "reduced twice (memory held under several paths, reached again at this line)",
              "self_overlap": "reading memory it writes (source and destination overlap)",
              "written_twice": "written twice in one load (the second write overwrote what the load had just written)"}
MAX_SITE_LINES = 20  # exit lines; report files keep every site


class TargetStats:
    """What the calls of one target (or one guard name) held, for summaries and exit diagnostics."""

    def __init__(self) -> None:
        self.calls = 0  # guarded calls
        self.unguarded_calls = 0  # calls KVGUARD_CALLS left out
        # The sampled tier (KVGUARD_SAMPLE=1/N; 0: off): calls it left unchecked, and of a kind's
        # optimizer-step intervals, how many it checked of how many
        self.sample_every = 0
        self.unsampled_calls = 0
        self.intervals_checked = 0
        self.intervals_seen = 0
        self.unguardable: dict[str, int] = {}  # calls skipped, by the argument's type
        self.protected = 0  # tensors protected over all calls
        self.moments = 0  # a process-wide kind's moments: forward passes, optimizer steps (`Kind.moment`)
        # stretches under other saved-tensor hooks that `guard_autograd` left unprotected, and saved
        # tensors it could not hold: what they saved was not looked at
        self.unprotected = 0
        self.keys_seen: set[Any] = set()  # top-level keys the argument held
        self.not_run: dict[str, int] = {}  # calls that did not run in this process, by reason
        self.sites: dict[SiteKey, SiteStats] = {}  # the writes of this target's calls, per site
        self.allowed: dict[str, int] = {}  # by reason

    @property
    def writes(self) -> int:
        return sum(site.writes for site in self.sites.values())

    @property
    def active(self) -> bool:
        """Whether the target did anything worth a summary line (else its exit line, if any, says why)."""
        return bool(self.calls or self.unguarded_calls or self.unsampled_calls or self.not_run or self.sites
                    or self.allowed)

    def as_record(self) -> dict[str, Any]:
        return {"calls": self.calls, "unguarded_calls": self.unguarded_calls,
                "unguardable_calls": sum(self.unguardable.values()), "protected": self.protected,
                "not_run_calls": sum(self.not_run.values()), "writes": self.writes, "moments": self.moments,
                "unprotected": self.unprotected, "sample_every": self.sample_every,
                "unsampled_calls": self.unsampled_calls, "intervals_checked": self.intervals_checked,
                "intervals_seen": self.intervals_seen}


class SiteStats:
    """Every write at one site: counts, the path patterns written, and the first example."""

    def __init__(self, event: MutationEvent, call: int, moment: Optional[int] = None) -> None:
        self.first = event
        self.first_call = call
        self.first_moment = moment  # a process-wide kind's forward pass or optimizer step (`Tally.add`)
        self.last_call = 0
        self.calls = 0
        self.last_moment: Optional[int] = None
        self.moments = 0
        self.writes = 0
        self.blocked = 0
        self.paths: dict[str, int] = {}
        self.shared: dict[str, None] = {}  # other paths to the memory written, as the events named them
        self.kinds: dict[str, int] = {}  # writes of the kinds an exit line names (`SAID_KINDS`)

    def add(self, event: MutationEvent, call: int, moment: Optional[int] = None) -> None:
        self.writes += 1
        self.blocked += event.blocked
        for path in event.aliases:
            self.shared.setdefault(collapse(path))
        if event.kind in SAID_KINDS:
            self.kinds[event.kind] = self.kinds.get(event.kind, 0) + 1
        key = collapse(event.path)
        self.paths[key] = self.paths.get(key, 0) + 1
        if call != self.last_call:  # calls run one after another; nested guards may count twice
            self.calls += 1
            self.last_call = call
        if moment is not None and moment != self.last_moment:
            self.moments += 1
            self.last_moment = moment

    def line(self, label: str = "") -> str:
        """`loss.py:775 aten.mul_.Tensor: 10,240 writes to rollout_data['kl'][*] in 10 calls (first: ...)`.

        A process-wide kind has one call: its moments are said instead (`... in 3 forward passes
        (first: <saved by ...>, forward pass 2)`, `... (first: model.fc.weight, after optimizer step 2)`).
        """
        paths = ", ".join(sorted(self.paths, key=lambda p: -self.paths[p])[:3])
        if len(self.paths) > 3:
            paths += f" (+{len(self.paths) - 3})"
        what = plural(self.writes, "write") + (" blocked" if self.blocked == self.writes else
                                               f" ({self.blocked:,} blocked)" if self.blocked else "")
        head = f"{self.first.site} {self.first.op}: {what} to {paths}"
        moment = self.first_moment
        more = self._more()
        kind = kind_of(label)
        if kind is not None and kind.moment is not None:
            counted = f" {kind.moment.count(self.moments)}" if kind.moment.at_sites and moment else ""
            return head + f"{counted} (first: {self.first.path}{kind.first_when(moment)}{more})"
        return head + f" in {plural(self.calls, 'call')} (first: {self.first.path}, call {self.first_call}{more})"

    def _more(self) -> str:
        """`; the same memory as m['acc_copy']; 2 reduced twice`: what the exit line adds to a site's first write."""
        text = ""
        if self.shared:
            text += "; the same memory as " + ", ".join(list(self.shared)[:3]) + (
                f" (+{len(self.shared) - 3})" if len(self.shared) > 3 else "")
        for kind, count in self.kinds.items():
            text += f"; {count:,} {SAID_KINDS[kind]}"
        return text

    def as_record(self) -> dict[str, Any]:
        ev = self.first
        return {"filename": ev.filename, "lineno": ev.lineno, "op": ev.op, "kind": ev.kind, "code": ev.code,
                "function": ev.function, "paths": dict(self.paths), "writes": self.writes, "blocked": self.blocked,
                "calls": self.calls, "shared": list(self.shared), "kinds": dict(self.kinds),
                "first": {"path": ev.path, "call": self.first_call, "placed_at": ev.placed_at, "tensor": ev.tensor,
                          "before": ev.before, "after": ev.after, "diff": ev.diff}}


class Tally:
    """The counts of one process, or of the guards of one process that write to one report directory."""

    def __init__(self) -> None:
        self.calls = 0
        self.targets: dict[str, TargetStats] = {}
        self.sites: dict[SiteKey, SiteStats] = {}
        self.allowed: dict[str, int] = {}  # by reason: `allow=PATTERN`, `kvguard.allow('...')`

    def clear(self) -> None:
        """Start from zero, in place: the guards counting here go on counting here."""
        self.__init__()  # type: ignore[misc]

    def target(self, label: str) -> TargetStats:
        return self.targets.setdefault(label, TargetStats())

    def begin_call(self, label: str) -> int:
        """Count a guarded call of `label`; returns its number in this tally."""
        self.calls += 1
        self.target(label).calls += 1
        return self.calls

    def not_run_call(self, label: str, reason: str) -> None:
        """Move a call counted by `begin_call` to "not run here": neither guarded nor clean.

        For a guarded call that did nothing in this process where an integration says the
        code does not run here (`_ranks.register_not_run_check`), e.g. a pipeline stage
        that is not the last.
        """
        self.calls -= 1
        stats = self.target(label)
        stats.calls -= 1
        stats.not_run[reason] = stats.not_run.get(reason, 0) + 1

    @property
    def not_run(self) -> dict[str, int]:
        """Calls that did not run in this process, by reason, over every target."""
        total: dict[str, int] = {}
        for stats in self.targets.values():
            for reason, count in stats.not_run.items():
                total[reason] = total.get(reason, 0) + count
        return total

    def add(self, event: MutationEvent, call: int, label: Optional[str] = None, moment: Optional[int] = None) -> None:
        """Count a write at its site, in the process's counts and in those of target `label`.

        `moment`: for a process-wide kind (`kvguard._kinds`), the forward pass or optimizer step
        the write came in, where its exit line speaks of those rather than of its one call.
        """
        key = (event.filename, event.lineno, event.op)
        for sites in [self.sites] + ([self.target(label).sites] if label is not None else []):
            site = sites.get(key)
            if site is None:
                site = sites[key] = SiteStats(event, call, moment)
            site.add(event, call, moment)

    def allow(self, reason: str, label: Optional[str] = None) -> None:
        for allowed in [self.allowed] + ([self.target(label).allowed] if label is not None else []):
            allowed[reason] = allowed.get(reason, 0) + 1

    @property
    def writes(self) -> int:
        return sum(site.writes for site in self.sites.values())

    @property
    def unguarded_calls(self) -> int:
        return sum(t.unguarded_calls for t in self.targets.values())

    def lines(self, tag: str = "", calls: Optional[str] = None) -> list[str]:
        """The exit summary: per target (or guard name) one line, then one indented line per site and allow reason.

        `kvguard: m:f(rollout_data): 3 guarded calls, 84 tensors protected, no in-place writes`:
        a clean run names what it watched. `calls` is the `KVGUARD_CALLS` setting, named
        when it left calls unguarded. Targets that did nothing have no line (their exit
        line says why); with none left, one line says so.
        """
        who = f"kvguard [{tag}]" if tag else "kvguard"
        active = [(label, stats) for label, stats in self.targets.items() if stats.active]
        if not active:  # never "no in-place writes": nothing was looked at (the lines after it say why)
            return [f"{who}: 0 guarded calls, so no write was checked"]
        lines = []
        for label, stats in active:
            lines.append(f"{who}: {display_label(label)}: {_head(stats, stats.sites, calls, label)}")
            lines += _detail_lines(stats.sites, stats.allowed, label)
        return lines

    def held_anything(self) -> bool:
        """Whether a guarded call ran or a process guard (`autograd`, `weights`, `data`) held a
        tensor or saw a write: entering a process guard alone is not that."""
        return any(stats.protected or stats.sites or stats.allowed or stats.unprotected
                   or (label not in KINDS and stats.active) for label, stats in self.targets.items())

    def counted(self, label: str) -> bool:
        """Whether a guard under `label` was entered (and counted) in this process."""
        stats = self.targets.get(label)
        return stats is not None and stats.calls > 0

    def as_record(self) -> dict[str, Any]:
        """The counts as plain JSON values, for a summary record."""
        return {"calls": self.calls, "unguarded_calls": self.unguarded_calls,
                "protected": sum(t.protected for t in self.targets.values()),
                "unprotected": sum(t.unprotected for t in self.targets.values()),
                "targets": {label: t.as_record() for label, t in self.targets.items()},
                "writes": self.writes, "blocked": sum(s.blocked for s in self.sites.values()),
                "sites": [s.as_record() for s in self.sites.values()], "allowed": dict(self.allowed),
                "not_run": self.not_run}


def display_label(label: str) -> str:
    """A target as it was named (`m:f(rollout_data)`, `autograd`); a guard made in code by its name."""
    return label if ":" in label or label in KINDS else f"kvguard.guard({label})"


def unprotected_text(count: int) -> str:
    """What `guard_autograd` could not protect: said with its exit line, never counted as clean."""
    return (f"{count:,} unprotected under other saved-tensor hooks (stretches of hooks torch.compile inlines, "
            "torch.func transforms, which refuse saved-tensor hooks, or saved tensors kvguard could not hold): what "
            "they saved was not looked at")


def _head(stats: TargetStats, sites: dict[SiteKey, SiteStats], calls: Optional[str], label: str = "") -> str:
    """`3 guarded calls (…left unguarded…), 2 calls not run here (…), 84 tensors protected, 6 writes at 2 sites`;
    for what autograd saved, `1,204 saved tensors protected in 12 forward passes, no in-place writes` (and
    what it left unprotected at the end, `; 2 unprotected under ...: ... not looked at`); for
    the weights, `148 parameters and buffers watched over 12 optimizer steps, no in-place writes`."""
    kind = kind_of(label)
    if kind is not None:
        writes = sum(site.writes for site in sites.values())
        if not (stats.protected or sites or stats.allowed or stats.unprotected) and kind.nothing_seen:
            return kind.nothing_seen  # never "no in-place writes" of what was never looked at
        return (kind.watched(stats.protected, stats.moments) + sampled_text(stats)
                + (f", {plural(writes, 'write')} at {plural(len(sites), 'site')}" if sites else
                   ", no in-place writes to them" if stats.unprotected else ", no in-place writes")
                + (f", {sum(stats.allowed.values()):,} allowed" if stats.allowed else "")
                + (f"; {unprotected_text(stats.unprotected)}" if stats.unprotected else ""))
    head = plural(stats.calls, "guarded call")
    if stats.unguarded_calls:
        head += f" ({stats.unguarded_calls:,} left unguarded by KVGUARD_CALLS={calls})"
    if stats.unsampled_calls:
        head += (f" ({stats.unsampled_calls:,} more not checked: sampled 1 in {stats.sample_every:,}, "
                 f"{stats.calls:,} of {stats.calls + stats.unsampled_calls:,} checked)")
    if stats.not_run:
        head += f", {plural(sum(stats.not_run.values()), 'call')} not run here ({not_run_reasons(stats.not_run)})"
    if stats.calls:
        head += f", {plural(stats.protected, 'tensor')} protected"
    writes = sum(site.writes for site in sites.values())
    head += f", {plural(writes, 'write')} at {plural(len(sites), 'site')}" if sites else ", no in-place writes"
    if stats.allowed:
        head += f", {sum(stats.allowed.values()):,} allowed"
    return head


def sampled_text(stats: TargetStats) -> str:
    """` (sampled 1 in 100: 37 of 3,701 step intervals checked)`, the stretches before, between and after
    optimizer steps: a sampled run never reads as a full one."""
    if not stats.sample_every:
        return ""
    return (f" (sampled 1 in {stats.sample_every:,}: {stats.intervals_checked:,} of "
            f"{plural(stats.intervals_seen, 'step interval')} checked)")


def _detail_lines(sites: dict[SiteKey, SiteStats], allowed: dict[str, int], label: str = "") -> list[str]:
    ordered = sorted(sites.values(), key=lambda s: -s.writes)
    lines = [f"  {site.line(label)}" for site in ordered[:MAX_SITE_LINES]]
    if len(ordered) > MAX_SITE_LINES:
        lines.append(f"  … and {plural(len(ordered) - MAX_SITE_LINES, 'more site')} (see the report files)")
    return lines + [f"  allowed: {plural(count, 'write')} by {reason}" for reason, count in allowed.items()]


def not_run_reasons(not_run: dict[str, int]) -> str:
    """`not the last pipeline stage: pp=0 of 2`, with counts when there are several reasons."""
    if len(not_run) == 1:
        return next(iter(not_run))
    return "; ".join(f"{count:,}: {reason}" for reason, count in not_run.items())


def short_site(filename: str, lineno: Any) -> str:
    """`loss.py:775` from a record's `filename` and `lineno`."""
    return f"{os.path.basename(str(filename))}:{lineno}"
