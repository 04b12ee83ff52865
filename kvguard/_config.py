"""Settings: every `KVGUARD*` variable is read here, for env activation and for every guard. Stdlib only.

Precedence, lowest first:
  1) built-in defaults
  2) ini (`kvguard_action` in pytest's ini file)
  3) environment (`KVGUARD`, `KVGUARD_*`)
  4) command line (`--kvguard`)
  5) the `kvguard` marker, or keyword arguments in code
Bad values raise `ConfigError` naming where they came from.

`KVGUARD` and `KVGUARD_TARGETS` switch env activation on and say what it guards. Every
other guard setting (`GUARD_VARIABLES`) is the default of every guard in the process:
`guard()`, `guarded`, env targets, the pytest plugin's guards, `guard_schedule`; an
argument given in code wins (`guard_defaults`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping, Optional

from kvguard import _presets
from kvguard._errors import ConfigError
from kvguard._kinds import KINDS
from kvguard._paths import parse_patterns
from kvguard._presets import Target, parse_target

OFF = "off"
ACTIONS = ("raise", "warn", "record")
_ACTION_ALIASES = {"": OFF, "0": OFF, "off": OFF, "false": OFF, "no": OFF,
                   "1": "warn", "on": "warn", "true": "warn", "yes": "warn",
                   "warn": "warn", "raise": "raise", "record": "record"}
DEFAULT_MAX_EVENTS = 100  # per process: ~70 KB of report file, ~100 events per guard in memory


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
class Sample:
    """The sampled tier (`KVGUARD_SAMPLE=1/100`): one unit in each block of `every` is checked
    fully (a guarded call of each target, an optimizer step's interval), and the first `first`
    of each always; `seed` None: the run id's, which every rank of one launch shares."""

    every: int = 1  # 1: every unit, the full tier
    seed: Optional[int] = None
    first: int = 3

    @property
    def on(self) -> bool:
        return self.every > 1

    def __str__(self) -> str:
        return f"1/{self.every}" + (f",seed={self.seed}" if self.seed is not None else "") + (
            f",first={self.first}" if self.first != 3 else "")


_SAMPLE = re.compile(r"^(?:1/(\d+)|(\d*\.?\d+(?:e-?\d+)?))((?:,\s*(?:seed|first)\s*=\s*\d+)*)$")


def parse_sample(value: str, source: str = "the KVGUARD_SAMPLE environment variable") -> Sample:
    """`1/100`, `0.01`, with `,seed=N` and `,first=N` (default 3) after it; `1`: every unit."""
    spelled = value.strip().lower()
    match = _SAMPLE.match(spelled)
    fraction = (1 / int(match.group(1)) if match.group(1) and int(match.group(1)) else
                float(match.group(2)) if match.group(2) else 0.0) if match else 0.0
    if match is None or not 0 < fraction <= 1:
        raise ConfigError(f"invalid sample {value.strip()!r} in {source}; expected a fraction of units to check "
                          "fully, 1/N or a number in (0, 1] (1/100, 0.01), optionally with ,seed=N and ,first=N")
    options = dict(re.findall(r"(seed|first)\s*=\s*(\d+)", match.group(3)))
    return Sample(max(1, round(1 / fraction)), int(options["seed"]) if "seed" in options else None,
                  int(options.get("first", 3)))


# The variables every guard takes its defaults from (set or not, an argument wins).
GUARD_VARIABLES = ("KVGUARD_KEYS", "KVGUARD_IGNORE", "KVGUARD_ALLOW", "KVGUARD_LEVEL", "KVGUARD_FINGERPRINT",
                   "KVGUARD_ENGINE", "KVGUARD_MAX_EVENTS", "KVGUARD_REPORT_DIR", "KVGUARD_CALLS", "KVGUARD_SAMPLE")
ENGINES = ("compiled", "kernels", "mode")
_SWITCHES = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False, "no": False}


@dataclasses.dataclass(frozen=True)
class GuardDefaults:
    """What the `KVGUARD_*` variables set for every guard; None where a variable is unset.

    A guard takes a value from here only for an option its caller did not give, and its
    own built-in default where this is None too.
    """

    keys: Optional[tuple[str, ...]] = None
    ignore: Optional[tuple[str, ...]] = None
    allow: Optional[tuple[str, ...]] = None
    level: Optional[str] = None
    fingerprint: Optional[bool] = None
    engine: Optional[str] = None  # compiled | kernels | mode; None: unset or "auto"
    max_events: Optional[int] = None
    report_dir: Optional[str] = None
    calls: Optional["Calls"] = None
    sample: Sample = Sample()  # KVGUARD_SAMPLE; unset: every unit


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """The variable's value, stripped; "" when unset. The one place kvguard reads its variables."""
    return (os.environ if environ is None else environ).get(name, "").strip()


_cached: tuple[tuple[str, ...], GuardDefaults] = ((), GuardDefaults())


def guard_defaults(environ: Optional[Mapping[str, str]] = None) -> GuardDefaults:
    """The guard settings of `environ` (default: this process's), each checked.

    Raises `ConfigError` naming the variable of a bad value. Read again whenever a
    variable changes (tests and notebooks set them at run time); parsed once per change.
    """
    global _cached
    raw = tuple(read(name, environ) for name in GUARD_VARIABLES)
    if raw == _cached[0]:
        return _cached[1]
    defaults = _parse_guard_defaults(dict(zip(GUARD_VARIABLES, raw)))
    if environ is None:
        _cached = (raw, defaults)
    return defaults


def _parse_guard_defaults(values: dict[str, str]) -> GuardDefaults:
    def given(name: str) -> Optional[str]:
        return values[name] or None

    level = given("KVGUARD_LEVEL")
    allow = given("KVGUARD_ALLOW")
    calls = given("KVGUARD_CALLS")
    defaults = GuardDefaults(
        keys=_keys(given("KVGUARD_KEYS")), ignore=_keys(given("KVGUARD_IGNORE")),
        allow=parse_patterns(allow, env_source("KVGUARD_ALLOW")) if allow is not None else None,
        level=parse_level(level, env_source("KVGUARD_LEVEL")) if level is not None else None,
        fingerprint=parse_switch(values["KVGUARD_FINGERPRINT"], "KVGUARD_FINGERPRINT"),
        engine=parse_engine(values["KVGUARD_ENGINE"]), max_events=parse_max_events(given("KVGUARD_MAX_EVENTS")),
        report_dir=given("KVGUARD_REPORT_DIR"), calls=parse_calls(calls) if calls is not None else None,
        sample=parse_sample(values["KVGUARD_SAMPLE"]) if values["KVGUARD_SAMPLE"] else Sample())
    if defaults.level == "light" and defaults.fingerprint is False:
        raise ConfigError("KVGUARD_LEVEL=light finds changes by value fingerprints only; it cannot run with "
                          "KVGUARD_FINGERPRINT=0")
    return defaults


def parse_switch(value: str, name: str) -> Optional[bool]:
    """On (`1`/`on`/`true`/`yes`), off (`0`/`off`/`false`/`no`), any case; None when empty."""
    spelled = value.strip().lower()
    if not spelled:
        return None
    if spelled not in _SWITCHES:
        raise ConfigError(f"invalid value {value.strip()!r} in {env_source(name)}; expected 1/on/true/yes "
                          "or 0/off/false/no")
    return _SWITCHES[spelled]


def parse_engine(value: str) -> Optional[str]:
    """`compiled`, `kernels` or `mode` from `KVGUARD_ENGINE`; None for unset or `auto`."""
    spelled = value.strip().lower()
    if spelled in ("", "auto"):
        return None
    if spelled not in ENGINES:
        raise ConfigError(f"invalid engine {value.strip()!r} in {env_source('KVGUARD_ENGINE')}; expected auto, "
                          f"{', '.join(ENGINES)} (any case)")
    return spelled


@dataclasses.dataclass(frozen=True)
class Settings:
    """What env activation does: the action, the targets, where reports go, what is allowed.

    `defaults` are the guard settings read at start-up; the targets' guards keep them
    for the life of the process.
    """

    action: str = OFF
    targets: tuple[Target, ...] = ()
    report_dir: Optional[str] = None
    keys: Optional[tuple[str, ...]] = None
    ignore: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    calls: Calls = Calls()
    level: str = "full"
    defaults: GuardDefaults = GuardDefaults()
    # The process-wide kinds KVGUARD_TARGETS names by word (`autograd`, `weights`, `data`: `kvguard._kinds`)
    kinds: tuple[str, ...] = ()
    # The presets only `all` named: a framework this process never imports is no gap for them
    implied_presets: tuple[str, ...] = ()

    def as_record(self) -> dict[str, object]:
        """The settings as plain JSON values, for report headers."""
        return {"action": self.action, "targets": [str(t) for t in self.targets] + list(self.kinds),
                "report_dir": self.report_dir,
                "keys": list(self.keys) if self.keys is not None else None, "ignore": list(self.ignore),
                "allow": list(self.allow), "calls": str(self.calls), "level": self.level}

    @property
    def active(self) -> bool:
        return self.action != OFF


LEVELS = ("full", "light")


def parse_level(value: object, source: str) -> str:
    """`full` (every op, and the boundaries) or `light` (the boundaries only), in any case."""
    return _one_of(value, "level", LEVELS, source)


def check_action(value: object, source: str) -> str:
    """A guard's action, `raise`, `warn` or `record`, in any case (`"Warn"` works like `KVGUARD=WARN`)."""
    return _one_of(value, "action", ACTIONS, source)


def _one_of(value: object, what: str, choices: tuple[str, ...], source: str) -> str:
    spelled = value.strip().lower() if isinstance(value, str) else value
    if spelled not in choices:
        expected = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise ConfigError(f"invalid {what} {value!r} from {source}; expected {expected} (any case)")
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


ALL = "all"  # the KVGUARD_TARGETS word for every kind and every preset


def named_kinds(value: str) -> tuple[str, ...]:
    """The process-wide kinds a KVGUARD_TARGETS value names by word (any case; `all`: every one), in `KINDS` order."""
    words = {item.strip().lower() for item in value.split(",")}
    return tuple(word for word in KINDS if word in words or ALL in words)


def implied_presets(value: str) -> tuple[str, ...]:
    """The presets a KVGUARD_TARGETS value names only through `all` (any case)."""
    items = [item.strip().lower() for item in value.split(",")]
    if ALL not in items:
        return ()
    named = {preset.name for item in items if (preset := _presets.preset_for(item)) is not None}
    return tuple(name for name in _presets.PRESETS if name not in named)


def parse_targets(value: str, source: str = env_source("KVGUARD_TARGETS")) -> tuple[Target, ...]:
    """Targets from a comma-separated list; names `source` on error.

    Each entry is `module:qualname(argname)` or, without a colon, a preset name (`slime`,
    `verl`, ...: see `_presets`), which stands for its functions, or one of the words
    `autograd` (what autograd saves), `weights` (every optimizer's parameters) and `data`
    (what every dataset returns), the process-wide kinds of `kvguard._kinds`: no
    function (`named_kinds`). A function named both by a preset and explicitly is
    guarded once, as the explicit entry says.
    """
    targets: list[Target] = []
    items = list(filter(str.strip, value.split(",")))
    if any(item.strip().lower() == ALL for item in items):  # every preset: each guards what the process imports
        items = [item for item in items if item.strip().lower() != ALL] + list(implied_presets(value))
    for item in items:
        if item.strip().lower() in KINDS:
            continue
        if ":" not in item:
            expanded: tuple[Target, ...] = _presets.expand(item, source, (*KINDS, ALL))
        else:
            expanded = (parse_target(item, source),)
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
    action = parse_action(read("KVGUARD", environ), env_source("KVGUARD"))
    if action == OFF:
        return Settings()
    named = read("KVGUARD_TARGETS", environ)
    targets = parse_targets(named)
    defaults = guard_defaults(environ)
    return Settings(action, targets, defaults.report_dir, defaults.keys, defaults.ignore or (), defaults.allow or (),
                    defaults.calls or Calls(), defaults.level or "full", defaults, named_kinds(named),
                    implied_presets(named))
