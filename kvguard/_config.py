"""Settings for env-var activation and the pytest plugin. Stdlib only.

Precedence, lowest first:
  1) defaults
  2) ini (`kvguard_action` in pytest's ini file)
  3) environment (`KVGUARD`, `KVGUARD_*`)
  4) command line (`--kvguard`)
  5) the `kvguard` marker, or keyword arguments in code
Bad values raise `ConfigError` naming where they came from.

`KVGUARD_REPORT_DIR` and `KVGUARD_MAX_EVENTS` apply to every guard in the process,
activated from the environment or not; the other variables to env targets only.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional

from kvguard._errors import ConfigError

OFF = "off"
ACTIONS = ("raise", "warn", "record")
_ACTION_ALIASES = {"": OFF, "0": OFF, "off": OFF, "false": OFF, "no": OFF,
                   "1": "warn", "on": "warn", "true": "warn", "yes": "warn",
                   "warn": "warn", "raise": "raise", "record": "record"}
DEFAULT_MAX_EVENTS = 100  # per process: ~70 KB of report file, ~100 events per guard in memory
_TARGET = re.compile(r"^\s*([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)\(\s*([A-Za-z_]\w*)\s*\)\s*$")


@dataclasses.dataclass(frozen=True)
class Target:
    """A function to guard on one argument: `module:qualname(argname)`."""

    module: str
    qualname: str
    argname: str

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}({self.argname})"


@dataclasses.dataclass(frozen=True)
class Calls:
    """Which calls of a target are guarded (`KVGUARD_CALLS`), numbered from 1."""

    kind: str = "all"  # all | first | every | range
    low: int = 1
    high: int = 0

    def selects(self, call: int) -> bool:
        if self.kind == "first":
            return call <= self.high
        if self.kind == "every":
            return (call - 1) % self.low == 0
        if self.kind == "range":
            return self.low <= call <= self.high
        return True

    def __str__(self) -> str:
        return {"all": "all", "first": f"first:{self.high}", "every": f"every:{self.low}",
                "range": f"{self.low}-{self.high}"}[self.kind]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What env activation does: the action, the targets, where reports go, what is allowed."""

    action: str = OFF
    targets: tuple[Target, ...] = ()
    report_dir: Optional[str] = None
    keys: Optional[tuple[str, ...]] = None
    ignore: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    calls: Calls = Calls()
    level: str = "full"

    def as_record(self) -> dict[str, object]:
        """The settings as plain JSON values, for report headers."""
        return {"action": self.action, "targets": [str(t) for t in self.targets], "report_dir": self.report_dir,
                "keys": list(self.keys) if self.keys is not None else None, "ignore": list(self.ignore),
                "allow": list(self.allow), "calls": str(self.calls), "level": self.level}

    @property
    def active(self) -> bool:
        return self.action != OFF


LEVELS = ("full", "light")


def parse_level(value: object, source: str) -> str:
    """`full` (every op, and the boundaries) or `light` (the boundaries only), in any case."""
    spelled = value.strip().lower() if isinstance(value, str) else value
    if spelled not in LEVELS:
        raise ConfigError(f"invalid level {value!r} from {source}; expected full or light (any case)")
    return str(spelled)


def parse_action(value: str, source: str) -> str:
    """`raise` / `warn` / `record` / `off` from a user's spelling; names `source` on error."""
    action = _ACTION_ALIASES.get(value.strip().lower())
    if action is None:
        raise ConfigError(
            f"invalid action {value!r} from {source}; expected raise, warn, record, or 0/off"
        )
    return action


def env_source(name: str) -> str:
    """How errors name a value that came from the environment variable `name`."""
    return f"the {name} environment variable"


def parse_targets(value: str, source: str = env_source("KVGUARD_TARGETS")) -> tuple[Target, ...]:
    """Targets from a comma-separated list; names `source` on error.

    Each entry is `module:qualname(argname)` or, without a colon, a preset name (`slime`,
    `verl`, ...: see `_presets`), which stands for its functions. A function named both
    by a preset and explicitly is guarded once, as the explicit entry says.
    """
    targets: list[Target] = []
    for item in filter(str.strip, value.split(",")):
        if ":" not in item:
            from kvguard import _presets

            expanded: tuple[Target, ...] = _presets.expand(item, source)
        else:
            match = _TARGET.match(item)
            if match is None:
                raise ConfigError(
                    f"invalid target {item.strip()!r} in {source}; expected module:qualname(argname), "
                    "e.g. myrl.loss:compute_advantages_and_returns(rollout_data)"
                )
            expanded = (Target(*match.groups()),)
        for target in expanded:
            same = [i for i, t in enumerate(targets) if (t.module, t.qualname) == (target.module, target.qualname)
                    and (type(t) is not Target or type(target) is not Target)]
            if not same:
                targets.append(target)
            elif type(target) is Target:  # explicit wins over a preset's entry for the same function
                targets[same[0]] = target
    return tuple(targets)


_CALLS = re.compile(r"^(?:(first|every):(\d+)|(\d+)-(\d+)|all)$")


def parse_calls(value: str, source: str = env_source("KVGUARD_CALLS")) -> Calls:
    """`first:N`, `every:N` (calls 1, N+1, 2N+1, ...), `N-M` or `all`; names `source` on error."""
    spelled = value.strip().lower()
    if not spelled:
        return Calls()
    match = _CALLS.match(spelled)
    numbers = [int(n) for n in match.groups() if n is not None and n.isdigit()] if match else []
    if match is None or 0 in numbers or (match.group(3) and numbers[0] > numbers[1]):
        raise ConfigError(f"invalid call selection {value.strip()!r} in {source}; expected first:N, every:N, "
                          "N-M (call numbers from 1, N <= M) or all")
    if match.group(1) == "first":
        return Calls("first", high=numbers[0])
    if match.group(1) == "every":
        return Calls("every", low=numbers[0])
    return Calls("range", numbers[0], numbers[1]) if numbers else Calls()


def parse_max_events(value: Optional[str], source: str = env_source("KVGUARD_MAX_EVENTS")) -> Optional[int]:
    """The cap on events kept per process, or None when unset; names `source` on error."""
    if value is None or not value.strip():
        return None
    if not value.strip().isdigit():
        raise ConfigError(f"invalid event cap {value.strip()!r} in {source}; expected a whole number "
                          f"(0 keeps none; default {DEFAULT_MAX_EVENTS})")
    return int(value)


def _keys(value: Optional[str]) -> Optional[tuple[str, ...]]:
    if value is None or not value.strip():
        return None
    return tuple(k.strip() for k in value.split(",") if k.strip())


def from_env(environ: Mapping[str, str]) -> Settings:
    """Settings from `KVGUARD` and the `KVGUARD_*` variables; every value is checked here."""
    from kvguard._allow import parse_patterns

    action = parse_action(environ.get("KVGUARD", ""), "the KVGUARD environment variable")
    if action == OFF:
        return Settings()
    targets = parse_targets(environ.get("KVGUARD_TARGETS", ""))
    report_dir = environ.get("KVGUARD_REPORT_DIR") or None
    parse_max_events(environ.get("KVGUARD_MAX_EVENTS"))  # read by every guard; checked once here
    return Settings(action, targets, report_dir, _keys(environ.get("KVGUARD_KEYS")),
                    _keys(environ.get("KVGUARD_IGNORE")) or (),
                    parse_patterns(environ.get("KVGUARD_ALLOW", ""), env_source("KVGUARD_ALLOW")),
                    parse_calls(environ.get("KVGUARD_CALLS", "")),
                    parse_level(environ.get("KVGUARD_LEVEL", "").strip() or "full", env_source("KVGUARD_LEVEL")))
