"""The warnings and errors kvguard raises about itself and its settings. Stdlib only; both pickle.

What it raises about a write (`MutationError`, `MutationWarning`) carries the write's event,
and so lives with the events: `kvguard._report.events`.
"""

from __future__ import annotations


class GuardWarning(UserWarning):
    """A guard that may have looked at nothing: it protected no tensor, or a `keys` name never appeared."""


class ConfigError(ValueError):
    """A kvguard setting has a value kvguard does not understand; the message names it."""
