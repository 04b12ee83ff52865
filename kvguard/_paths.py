"""Paths as reports print them (`rollout_data['kl'][3]`) and patterns over them. Stdlib only.

A pattern is a path with `[*]` for any list index (and `*` elsewhere, outside quotes, for
any run of characters); it covers everything below it. One
quote-aware scanner reads paths and patterns for every job here: splitting a list of
patterns, checking that brackets and quotes close, collapsing indices to `[*]`, so a
bracket or comma inside a quoted key (`d['a[0],b']`) means the same to all of them.
"""

from __future__ import annotations

import functools
import re
from kvguard._errors import ConfigError

_INDEX = re.compile(r"\[-?\d+\]")
_STAR = re.escape("[*]")
EXAMPLE = "rollout_data['advantages'][*]"


def _unquoted(text: str) -> tuple[list[tuple[int, str]], bool]:
    """The characters of `text` outside quoted keys, with their index; and whether a quote is left open."""
    out, quote = [], ""
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        else:
            out.append((i, char))
    return out, bool(quote)


def split(value: str) -> list[str]:
    """A comma-separated list of patterns; commas inside brackets or quotes belong to a pattern."""
    parts, start, depth = [], 0, 0
    for i, char in _unquoted(value)[0]:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(value[start:i])
            start = i + 1
    return parts + [value[start:]]


def balanced(text: str) -> bool:
    """Whether every bracket and quote of `text` closes."""
    chars, quote_open = _unquoted(text)
    depth = 0
    for _, char in chars:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0 and not quote_open


@functools.lru_cache(maxsize=4096)
def collapse(path: str) -> str:
    """`path` with list indices as `[*]`: `rollout_data['kl'][3]` -> `rollout_data['kl'][*]`.

    Indices inside quoted keys (`d['a[0]']`) stay as they are.
    """
    out, done = [], 0
    for i, char in _unquoted(path)[0]:
        match = _INDEX.match(path, i) if char == "[" and i >= done else None
        if match is not None:
            out += [path[done:i], "[*]"]
            done = match.end()
    return "".join(out) + path[done:]


def check_pattern(pattern: object, source: str) -> str:
    """`pattern`, stripped, if its brackets and quotes close; else a ConfigError naming `source`."""
    if not isinstance(pattern, str) or not pattern.strip() or not balanced(pattern.strip()):
        raise ConfigError(f"invalid allow pattern {pattern!r} in {source}; expected a path as reports print it, "
                          f"e.g. {EXAMPLE}")
    return pattern.strip()


def parse_patterns(value: str, source: str) -> tuple[str, ...]:
    """Comma-separated patterns, each checked; names `source` on error."""
    return tuple(check_pattern(p, source) for p in split(value) if p.strip())


def matcher(pattern: str) -> re.Pattern[str]:
    """A regex matching the paths `pattern` covers: itself, with any index for `[*]`, and below.

    A `*` elsewhere outside quotes matches any run of characters, so that a saved tensor's
    path can be named by its node alone: `<saved by SinBackward0: *`.
    """
    pieces, done = [], 0
    for i, char in _unquoted(pattern)[0]:
        if char == "*" and pattern[i - 1:i + 2] != "[*]":
            pieces += [_escaped(pattern[done:i]), ".*"]
            done = i + 1
    return re.compile("".join(pieces) + _escaped(pattern[done:]) + r"(?=$|[\[.])")


def _escaped(text: str) -> str:
    return re.escape(text).replace(_STAR, _INDEX.pattern)
