"""Find the user's frame behind an op: its file, line, function and source text.

Stdlib only. Frames inside torch, kvguard and wrapt are skipped; the first frame
outside them is "the user's". The statement that placed a tensor is found from these
frames by `placements`.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import re
import sys
import sysconfig
import threading
import types
from typing import Any, Callable, Collection, Iterator, NamedTuple, Optional

# (lineno, end_lineno, col, end_col) of an instruction, as `co_positions` gives them (columns may be None).
_Position = tuple[int, Optional[int], Optional[int], Optional[int]]
# The machinery between the user's line and the op: its frames are never the user's.
_MACHINERY = ("torch", "wrapt", "typing_extensions")
# Container libraries whose methods write on the caller's behalf (`td.mul_(2)`, `td[1:3] = ...`,
# `td.update_(...)`): the line that called them is the user's. Only an installed copy counts
# (one under site-packages or dist-packages), so a user's own module that shares a name
# (`tree.py` next to the script) is never skipped. The standard library's containers
# (`collections`, `dataclasses`, `functools`, `contextlib`) are skipped as the standard library.
CONTAINER_LIBRARIES = ("tensordict", "optree", "tree")
# kvguard's own files, wherever it is installed: the package directory above this room.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_skip_prefixes: Optional[tuple[str, ...]] = None
_skip_found: tuple[tuple[str, int, Optional[str]], ...] = ()  # the modules `_skip_prefixes` was built from


def _internal_prefixes() -> tuple[str, ...]:
    """Where the internal files are; built again when one of those packages is imported (or
    imported again from elsewhere), which also forgets the per-file decisions made so far."""
    global _skip_prefixes, _skip_found
    found = tuple((name, id(module), getattr(module, "__file__", None))
                  for name in (*_MACHINERY, *CONTAINER_LIBRARIES) if (module := sys.modules.get(name)) is not None)
    if _skip_prefixes is None or found != _skip_found:
        _skip_found = found
        _internal_files.clear()
        dirs = [PACKAGE_DIR]
        for name in _MACHINERY:
            dirs += _package_prefixes(name)
        for name in CONTAINER_LIBRARIES:
            dirs += [d for d in _package_prefixes(name) if _installed(d)]
        _skip_prefixes = tuple(dirs)
    return _skip_prefixes


def _package_prefixes(name: str) -> list[str]:
    """The directory of an imported package (its file, for a single-file module)."""
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if isinstance(file, str) and file:
        path = os.path.abspath(file)
        return [os.path.dirname(path) + os.sep if os.path.basename(path).startswith("__init__.") else path]
    paths = getattr(module, "__path__", None)  # a namespace package: each of its directories
    try:
        return [os.path.abspath(p) + os.sep for p in paths or () if isinstance(p, str)]
    except Exception:  # noqa: BLE001 - an odd __path__
        return []


def _installed(prefix: str) -> bool:
    parts = prefix.split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts


_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _is_internal(filename: str) -> bool:
    """Frames of torch, kvguard, wrapt, typing_extensions, installed container libraries
    (`CONTAINER_LIBRARIES`) and the standard library."""
    if filename.startswith(_internal_prefixes()) or filename.startswith("<frozen"):
        return True
    return filename.startswith(_STDLIB) and "-packages" + os.sep not in filename


def user_frames(start: Optional[types.FrameType] = None) -> Iterator[types.FrameType]:
    """Frames outside torch, kvguard and wrapt, innermost first."""
    frame: Optional[types.FrameType] = start if start is not None else sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = _internal_files.get(filename)
        if internal is None:
            if len(_internal_files) >= 4096:
                _internal_files.clear()
            internal = _internal_files[filename] = _is_internal(
                filename if os.path.isabs(filename) else os.path.abspath(filename))
        if not internal:
            yield frame
        frame = frame.f_back


def first_user_line(frame: Optional[types.FrameType]) -> Optional[tuple[str, int]]:
    """(co_filename, line) of the innermost frame outside torch, kvguard and wrapt: `user_frames`'
    first, without a generator (it runs for every tensor autograd saves under `guard_autograd`)."""
    internal_files = _internal_files
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = internal_files.get(filename)
        if internal is None:
            internal = next(user_frames(frame), None) is not frame
        if not internal:
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


# co_filename -> whether its frames are internal (a relative name is read against the
# working directory of its first sighting, as the interpreter compiled it)
_internal_files: dict[str, bool] = {}


class Site(NamedTuple):
    """A source location, as plain data."""

    filename: str
    lineno: int
    function: str
    code: str

    @property
    def short(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.lineno}"


UNKNOWN_SITE = Site("<unknown>", 0, "<unknown>", "")


def user_site() -> Site:
    """Where the user's code is now: the innermost frame outside torch, kvguard and wrapt
    (or the site a caller named with `located`, for writes no frame shows)."""
    named: Optional[Callable[[], Site]] = getattr(_located, "site", None)
    if named is not None:
        return named()
    return site_of(next(user_frames(sys._getframe(1)), None))


class located:
    """`with located(site):` reports made on this thread inside the block are at `site()`, asked
    only when a report needs it: a compiled graph's write is at its source line, which no
    Python frame runs."""

    def __init__(self, site: Callable[[], Site]) -> None:
        self.site = site

    def __enter__(self) -> None:
        self._outer = getattr(_located, "site", None)
        _located.site = self.site

    def __exit__(self, *exc: object) -> None:
        _located.site = self._outer


_located = threading.local()


_FX_COMMENT = re.compile(r"#\s*File: (?P<file>.+?):(?P<line>\d+) in (?P<function>\S+), code: (?P<code>.*)$")


def fx_comment_site(comment: str) -> Optional[Site]:
    """The site an FX node comment names (`# File: job.py:7 in shape, code: k *= coef`), as the
    comment says it: a cached graph's comment may be older than the file, or from another file."""
    found = _FX_COMMENT.search(comment)
    if found is None:
        return None
    return Site(found["file"], int(found["line"]), found["function"], found["code"].strip())


def site_of(frame: Optional[types.FrameType]) -> Site:
    if frame is None:
        return UNKNOWN_SITE
    code = frame.f_code
    if code.co_filename.startswith("<eval_with_key>"):
        traced = _traced_site(frame)
        if traced is not None:
            return traced
    line = linecache.getline(code.co_filename, frame.f_lineno, frame.f_globals).strip()
    return Site(code.co_filename, frame.f_lineno, code.co_name, line)


_STACK_TRACE_FILE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


def _traced_site(frame: types.FrameType) -> Optional[Site]:
    """The source line a `torch.compile`d graph's op came from (its FX node's stack trace).

    A write hook sees compiled code's writes from the generated `forward`, whose lines
    mean nothing to the user; FX maps each generated line to the node it runs.
    """
    try:
        module: Any = frame_namespace(frame).get("self")
        node_index = module._lineno_map.get(frame.f_lineno - getattr(module, "_prologue_start", 0))
        trace = list(module.graph.nodes)[node_index].meta.get("stack_trace") or ""
        found = list(_STACK_TRACE_FILE.finditer(trace))[-1]
    except Exception:  # noqa: BLE001 - not an FX graph module, or no trace kept: the generated line
        return None
    filename, lineno = found["file"], int(found["line"])
    return Site(filename, lineno, found["function"], linecache.getline(filename, lineno).strip())


# Before PEP 667 (Python 3.13) reading `f_locals` leaves a snapshot dict on the frame.
_LOCALS_SNAPSHOT = sys.version_info < (3, 13)


def frame_namespace(frame: types.FrameType) -> dict[str, object]:
    """The names visible in `frame` (its globals, then its locals), without pinning its locals.

    On Python <= 3.12 reading `f_locals` stores a snapshot of every local on the frame
    until the function returns, so a tensor the user deletes later in that function
    would stay alive (GPU memory held across a step). The snapshot is emptied again
    unless someone else holds it (a `locals()` result); any later read rebuilds it.
    """
    local = frame.f_locals
    namespace = {**frame.f_globals, **local}
    _unpin_locals(frame, local)
    return namespace


def _unpin_locals(frame: types.FrameType, local: dict[str, object]) -> None:
    """Empty the frame's snapshot of its locals (`frame_namespace`) when only we hold it."""
    # Held by the frame, by `local`, by this call and by getrefcount's argument: nobody else sees it.
    if _LOCALS_SNAPSHOT and frame.f_code.co_flags & inspect.CO_OPTIMIZED and sys.getrefcount(local) <= 4:
        local.clear()


def frame_names(frame: types.FrameType, names: Collection[str]) -> dict[str, object]:
    """`frame_namespace` for `names` only: a trainer module's globals are not copied whole
    (that copy, per frame read, was what made a placement cost more the deeper the stack)."""
    local = frame.f_locals
    found = {name: local[name] for name in names if name in local}
    if len(found) < len(names):
        globals_ = frame.f_globals
        found.update((name, globals_[name]) for name in names if name not in found and name in globals_)
    _unpin_locals(frame, local)
    return found


def call_argument_text(frame: types.FrameType, callee_names: Collection[str]) -> Optional[str]:
    """The source text of the first argument of the call `frame` is executing.

    `kvguard.guard(self.rollout_data)` gives "self.rollout_data". Only calls whose
    function is named one of `callee_names` count, and only arguments that name
    something (a variable, an attribute, an item); None otherwise. Remembered per call
    site: a guard entered in a loop reads the source once.
    """
    key = (frame.f_code, frame.f_lasti, tuple(callee_names))
    if key not in _argument_texts:
        if len(_argument_texts) >= _MAX_REMEMBERED:
            _argument_texts.clear()
        _argument_texts[key] = _call_argument_text(frame, callee_names)
    return _argument_texts[key]


_argument_texts: dict[tuple[types.CodeType, int, tuple[str, ...]], Optional[str]] = {}
_MAX_REMEMBERED = 4096


def _call_argument_text(frame: types.FrameType, callee_names: Collection[str]) -> Optional[str]:
    tree = parsed_source(frame.f_code.co_filename)
    if tree is None:
        return None
    where = _instruction_position(frame)
    best: Optional[ast.Call] = None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and _callee_name(node.func) in callee_names):
            continue
        if not _contains(node, where):
            continue
        if best is None or _contains(best, (node.lineno, node.end_lineno, node.col_offset, node.end_col_offset)):
            best = node  # the innermost matching call
    if best is None:
        return None
    argument = best.args[0]
    if not isinstance(argument, (ast.Name, ast.Attribute, ast.Subscript)):
        return None  # a literal or a call: no name to give it
    source = "".join(linecache.getlines(frame.f_code.co_filename))
    text = ast.get_source_segment(source, argument)
    return " ".join(text.split()) if text else None


def _instruction_position(frame: types.FrameType) -> _Position:
    """(lineno, end_lineno, col, end_col) of the running instruction; columns None before 3.11."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is not None and frame.f_lasti >= 0:
        for i, position in enumerate(positions()):
            if i == frame.f_lasti // 2 and position[0] is not None:
                return (position[0], position[1], position[2], position[3])
    return (frame.f_lineno, frame.f_lineno, None, None)


def _contains(node: ast.AST, where: _Position) -> bool:
    line, end_line, col, end_col = where
    start, stop = (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
    if col is None or end_col is None:
        return bool(start[0] <= line and end_line <= stop[0])
    return bool(start <= (line, col) and (end_line, end_col) <= stop)


def _callee_name(func: ast.AST) -> Optional[str]:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def drop_internal_frames(exc: BaseException) -> None:
    """Keep only the user's frames in the traceback, so that it ends at the user's line.

    Frames of torch's dispatcher and Dynamo, kvguard's call wrappers and engines, wrapt and
    the standard library go, also between two user frames (a guarded function's wrapper
    sits between its caller and its body). A traceback with no user frame stays as it is.
    Called while the error passes through kvguard's own frames: a bare `raise` there, and
    Python's own re-raise at a `with` block's end, raise it with this traceback.
    """
    kept, tb = [], exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not _is_internal(filename if os.path.isabs(filename) else os.path.abspath(filename)):
            kept.append(tb)
        tb = tb.tb_next
    if not kept:
        return
    for outer, inner in zip(kept, kept[1:]):
        outer.tb_next = inner
    kept[-1].tb_next = None
    exc.__traceback__ = kept[0]


_module_cache: dict[str, Optional[ast.Module]] = {}


def parsed_source(filename: str) -> Optional[ast.Module]:
    """The module `filename` holds, parsed once (None: no source, or not Python)."""
    if filename not in _module_cache:
        try:
            _module_cache[filename] = ast.parse("".join(linecache.getlines(filename)))
        except (SyntaxError, ValueError):
            _module_cache[filename] = None
    return _module_cache[filename]
