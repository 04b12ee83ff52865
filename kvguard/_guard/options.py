"""A guard's options resolved once: each argument given wins, else its `KVGUARD_*` setting, else the default.

What `Guard` and its callers are told, checked here with errors naming where each value
came from (an argument, or the environment variable).
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Iterable, Optional, Union

from kvguard import _intended
from kvguard._config import DEFAULT_MAX_EVENTS, GuardDefaults, check_action, guard_defaults, parse_level
from kvguard._errors import ConfigError
from kvguard._guard.allow import Allowlist
from kvguard._state import STATE


@dataclasses.dataclass(frozen=True)
class Options:
    action: str
    level: str  # "full" (every op and the boundaries) or "light" (the boundaries only)
    fingerprint: bool  # compare values by digest at the boundaries
    keys: Optional[tuple[object, ...]]  # protect only these top-level keys; None: all
    keys_from: str  # where `keys` came from, for the warning when one never appears
    ignore: tuple[object, ...]
    allow: Allowlist
    keep: Optional[int]  # events kept in the report (None: all)


def resolve(action: Optional[str], level: Optional[str], fingerprint: Optional[bool],
            keys: Optional[Collection[object]], ignore: Optional[Collection[object]],
            allow: Optional[Collection[str]], target: Optional[str], intended_for: Optional[str] = None) -> Options:
    """The options of a new guard (`target`: the env target it guards, if any; `intended_for`: the
    target whose well-known intended writers it lets through, `kvguard._intended`)."""
    settings = _settings_for(target)
    checked_action = check_action("raise" if action is None else action, "kvguard.guard(action=...)")
    checked_level = parse_level(level, "kvguard.guard(level=...)") if level is not None else settings.level or "full"
    # On unless given off, or KVGUARD_FINGERPRINT says 0/off/false/no.
    fingerprints = settings.fingerprint is not False if fingerprint is None else bool(fingerprint)
    if checked_level == "light" and not fingerprints:
        raise ConfigError(f"kvguard.guard(level='light') finds changes by value fingerprints only; it cannot run "
                          f"with {'fingerprint=False' if fingerprint is not None else 'KVGUARD_FINGERPRINT=0'}"
                          + (" (level='light' from KVGUARD_LEVEL)" if level is None else ""))
    keys_from = "keys=..." if keys is not None or settings.keys is None else "KVGUARD_KEYS"
    allowed, allow_from = ((allow, "kvguard.guard(allow=...)") if allow is not None else
                           (settings.allow or (), "the KVGUARD_ALLOW environment variable"))
    # Events kept in the report: all under record with no KVGUARD_MAX_EVENTS, else the cap.
    cap = settings.max_events
    keep = None if cap is None and checked_action == "record" else DEFAULT_MAX_EVENTS if cap is None else cap
    return Options(checked_action, checked_level, fingerprints,
                   _as_keys(keys if keys is not None else settings.keys, "keys"), keys_from,
                   _as_keys(ignore if ignore is not None else settings.ignore or (), "ignore") or (),
                   Allowlist(allowed, allow_from, _intended.scopes(intended_for) if intended_for else (),
                             _intended.unread(intended_for) if intended_for else ()), keep)


def _as_keys(keys: Union[int, Iterable[object], None], what: str) -> Optional[tuple[object, ...]]:
    if keys is None:
        return None
    if isinstance(keys, (str, bytes, int)):
        return (keys,)
    try:
        return tuple(keys)
    except TypeError:
        raise TypeError(f"kvguard.guard({what}=...) takes a key or a collection of keys, got {keys!r}") from None


def _settings_for(target: Optional[str]) -> GuardDefaults:
    """The `KVGUARD_*` guard settings a new guard takes for the options it was not given.

    An env target's guard keeps those read when activation started (checked then: a bad
    one means no activation), so a variable changed later cannot fail the user's call.
    Any other guard reads them now, and a bad value is a `ConfigError` naming the variable.
    """
    settings = STATE.settings
    if target is not None and settings is not None and settings.active:
        return settings.defaults  # type: ignore[no-any-return]
    return guard_defaults()
