"""Plain records of detected mutations. Stdlib only; never holds a protected tensor."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

@dataclasses.dataclass(frozen=True)
class MutationEvent:
    """One in-place write to a protected tensor, as plain text and numbers.

    Example::

        ev.path       "rollout_data['kl'][0]"
        ev.op         "aten.mul_.Tensor"
        ev.kind       "write" | "metadata" | "repoint" | "unobserved"
        ev.filename   "/src/loss.py";  ev.lineno 212;  ev.code "k *= kl_coef"
        ev.placed_at  "loss.py:201" (None when the tensor was there before the guard began)
    """

    path: str
    op: str
    kind: str
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
    aliases: tuple[str, ...] = ()  # other paths to the same tensor
    detached: bool = False  # removed from (or replaced in) the guarded object before the write

    @property
    def site(self) -> str:
        """`loss.py:212`, the short location used in messages."""
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    def headline(self) -> str:
        """One sentence naming who, what and where."""
        if self.kind == "unobserved":
            return (
                f"{self.path} changed during the guard, but no dispatched op wrote it "
                f"(found by a boundary check, at guard exit or g.check(), {self.site})"
            )
        verb = "would be" if self.blocked else "was"
        what = {
            "write": "modified in place",
            "metadata": "reshaped in place (metadata only)",
            "repoint": "re-pointed to other memory",
        }.get(self.kind, "modified in place")
        return f"{self.path} {verb} {what} by {self.op} at {self.site}"

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
        from kvguard._render import format_report

        return format_report(self)

    def __str__(self) -> str:
        return self.format()

    def __rich__(self) -> Any:
        from kvguard._render import rich_report

        return rich_report(self)
