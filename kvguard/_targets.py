"""One function to guard, `module:qualname(argname)`, and its grammar. Stdlib only.

A list of them (`KVGUARD_TARGETS`, where a name without a colon is a preset) is read by
`_config.parse_targets`; the presets (`_presets`) spell their functions in this grammar.
"""

from __future__ import annotations

import dataclasses
import re

from kvguard._errors import ConfigError

_TARGET = re.compile(r"^\s*([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)\(\s*([A-Za-z_]\w*)\s*\)\s*$")


@dataclasses.dataclass(frozen=True)
class Target:
    """A function to guard on one argument: `module:qualname(argname)`."""

    module: str
    qualname: str
    argname: str

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}({self.argname})"


def parse_target(item: str, source: str) -> Target:
    """One explicit `module:qualname(argname)`; a `ConfigError` naming `source` if it is not one."""
    match = _TARGET.match(item)
    if match is None:
        raise ConfigError(
            f"invalid target {item.strip()!r} in {source}; expected module:qualname(argname), "
            "e.g. myrl.loss:compute_advantages_and_returns(rollout_data)"
        )
    return Target(*match.groups())
