"""Whether the intended writers' table (`kvguard/_intended.py`) names functions the installed libraries have.

Stdlib only: imported by tests/test_intended.py (torch, in-process) and by the jobs of
tests/test_real_libraries.py (transformers, peft, trl, in the Python of the library line
under test). Only modules already imported are searched: a pattern over a package
(`transformers.*`) needs one of its modules loaded, as a job that uses it loads them.
"""

from __future__ import annotations

import fnmatch
import sys
from typing import Any

from kvguard import _intended


def unmatched(writer: _intended.Writer) -> list[str]:
    """The functions of `writer` that no function of an imported module matches, with the arguments it names."""
    missing = []
    for function in writer.functions:
        name, paren, arguments = function.partition("(")
        module, _, qualname = name.partition(":")
        names = set(arguments.rstrip(")").split("|")) if paren else set()
        if not any(_has(value, modname, qualname, names) for modname in list(sys.modules)
                   if fnmatch.fnmatchcase(modname, module) for value in _members(sys.modules[modname])):
            missing.append(function)
    return missing


def _members(module: Any) -> list[Any]:
    found = []
    for value in list(vars(module).values()) if module is not None else ():
        found.append(value)
        if isinstance(value, type):
            found.extend(vars(value).values())
    return found


def _has(value: Any, module: str, qualname: str, names: set[str]) -> bool:
    value = getattr(value, "__func__", value)  # a staticmethod or classmethod
    for _ in range(8):  # a decorated function (`@torch.no_grad()`): the function it wraps runs
        wrapped = getattr(value, "__wrapped__", None)
        if wrapped is None:
            break
        value = wrapped
    code = getattr(value, "__code__", None)
    if code is None or getattr(value, "__module__", None) != module:
        return False
    if not fnmatch.fnmatchcase(getattr(value, "__qualname__", code.co_name), qualname):  # co_qualname: 3.11+
        return False
    arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return not names or bool(names & set(arguments))


def version_errors(writer: _intended.Writer) -> list[str]:
    """What is wrong with the versions `writer` says it was read and tested in."""
    read = [v.strip() for v in writer.read_in.split(",") if v.strip()]
    tested = [v.strip() for v in writer.tested.split(",") if v.strip()]
    errors = [f"read in {v}, outside {writer.versions}" for v in read if not _intended.in_range(v, writer.versions)]
    errors += [f"tested in {v}, not read there" for v in tested if v not in read]
    return errors + ([] if read else ["read in no version"])


if __name__ == "__main__":  # `python intended_table.py DIST...`: the unmatched functions of those libraries
    import json

    print(json.dumps({w.name: unmatched(w) for w in _intended.WRITERS
                      if w.distribution in sys.argv[1:] and w.how == "scope"}))
