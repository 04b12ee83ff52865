"""Settings for env-var activation and the pytest plugin. Stdlib only.

Precedence, lowest first:
  1) defaults
  2) ini (`kvguard_action` in pytest's ini file)
  3) environment (`KVGUARD`, `KVGUARD_*`)
  4) command line (`--kvguard`)
  5) the `kvguard` marker, or keyword arguments in code
Bad values raise `ConfigError` naming where they came from.
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
class Settings:
    """What env activation does: the action, the targets, where reports go."""

    action: str = OFF
    targets: tuple[Target, ...] = ()
    report_dir: Optional[str] = None
    keys: Optional[tuple[str, ...]] = None
    ignore: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.action != OFF


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
    """Targets from a comma-separated `module:qualname(argname)` list; names `source` on error."""
    targets = []
    for item in filter(str.strip, value.split(",")):
        match = _TARGET.match(item)
        if match is None:
            raise ConfigError(
                f"invalid target {item.strip()!r} in {source}; expected module:qualname(argname), "
                "e.g. myrl.loss:compute_advantages_and_returns(rollout_data)"
            )
        targets.append(Target(*match.groups()))
    return tuple(targets)


def _keys(value: Optional[str]) -> Optional[tuple[str, ...]]:
    if value is None or not value.strip():
        return None
    return tuple(k.strip() for k in value.split(",") if k.strip())


def from_env(environ: Mapping[str, str]) -> Settings:
    """Settings from `KVGUARD`, `KVGUARD_TARGETS`, `KVGUARD_REPORT_DIR`, `KVGUARD_KEYS`, `KVGUARD_IGNORE`."""
    action = parse_action(environ.get("KVGUARD", ""), "the KVGUARD environment variable")
    if action == OFF:
        return Settings()
    targets = parse_targets(environ.get("KVGUARD_TARGETS", ""))
    report_dir = environ.get("KVGUARD_REPORT_DIR") or None
    return Settings(action, targets, report_dir, _keys(environ.get("KVGUARD_KEYS")),
                    _keys(environ.get("KVGUARD_IGNORE")) or ())
