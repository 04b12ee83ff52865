"""Find the user's frame behind an op, and the statement that placed a tensor in a dict.

Stdlib only. Frames inside torch, kvguard and wrapt are skipped; the first frame
outside them is "the user's". Placement is found by reading the user's source: the
latest statement at or before the current line that stores into a container that now
holds the new tensor (`rollout_data["kl"] = kl`, `d.update(...)`, `lst.append(t)`,
`exp.kl = t`, `setattr(exp, "kl", t)`, `td.set("kl", t)`).
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
from collections import deque
from typing import Any, Callable, Collection, Iterator, NamedTuple, Optional, Sequence

from kvguard._protect.tree import Attr

_ANY = object()  # a key the source does not spell as a constant
# `(container, step)` from the guarded object down to a tensor, as `tree` walks it (`Leaf.chain`).
Chain = tuple[tuple[object, object], ...]
# (lineno, end_lineno, col, end_col) of an instruction, as `co_positions` gives them (columns may be None).
_Position = tuple[int, Optional[int], Optional[int], Optional[int]]
_STORE_METHODS = frozenset({"update", "setdefault", "append", "extend", "insert", "__setitem__", "__ior__",
                            "set", "__setattr__", "appendleft", "extendleft"})
_MAX_FRAMES = 12
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
    tree = _parse(frame.f_code.co_filename)
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


# A frame's stores by the object they store into: id -> [(store's position, store, object)].
_StoresByObject = dict[int, list[tuple[int, "_Store", object]]]


class Placements:
    """Where the tensors one look protects were placed, searched in the user frames given.

    For a tensor that `chain` (`(container, key)` from the guarded object down to it)
    reaches, the search looks at the frames, innermost first, for a store into any of
    those containers, preferring a line at or before the frame's current line, then one
    whose stored value names the tensor (or a container on its way: `q.appendleft(t)`,
    `rd["b"] = {"deep": [t]}`) over branches not taken, then the right key. Each frame's
    names and stores are read once, at the first tensor that needs them, not once per
    tensor: a deep caller's stack holds many frames with many stores, and a placement
    may bring thousands of tensors.
    """

    def __init__(self, frames: list[types.FrameType]) -> None:
        self._frames = frames[:_MAX_FRAMES]
        self._read: list[Optional[tuple[types.FrameType, dict[str, object], _StoresByObject]]] = [None] * len(self._frames)
        # id of a tensor's container -> the answer for every tensor in it, where the answer
        # cannot depend on which tensor it is: a list of 448 placed tensors is searched once.
        self._by_container: dict[int, str] = {}

    def placed_at(self, chain: Chain, placed: object) -> str:
        """`file.py:LINE` of the statement that placed it; else of the innermost frame, "(first seen)"."""
        container = id(chain[-1][0]) if chain else None
        known = self._by_container.get(container) if container is not None else None
        if known is not None:
            return known
        depends: list[bool] = []  # set when a store's score depended on the tensor or its own key
        site = self.site(chain, placed, depends)
        text = site.short if site is not None else (
            f"{site_of(self._frames[0] if self._frames else None).short} (first seen)")
        if container is not None and not depends:
            self._by_container[container] = text
        return text

    def placed_at_run(self, chain: Chain, lst: Sequence[object], tensors: Sequence[object]) -> list[str]:
        """`placed_at` for each tensor of a list (at `chain`): one search for all where it can."""
        if not tensors:
            return []
        first = self.placed_at(chain + ((lst, 0),), tensors[0])
        if id(lst) in self._by_container:
            return [first] * len(tensors)
        return [first] + [self.placed_at(chain + ((lst, i),), t) for i, t in enumerate(tensors) if i]

    def site(self, chain: Chain, placed: object = _ANY,
             depends: Optional[list[bool]] = None) -> Optional[Site]:
        """The statement that put `placed` where `chain` says it is, if the source shows it.

        `depends`, if given, receives True when the answer could differ for another tensor
        in the same container (a store naming a tensor, or one into its own index)."""
        for i in range(len(self._frames)):
            frame, namespace, by_object = self._frame(i)
            found = _placement_in_frame(frame, namespace, by_object, chain, placed, depends) if by_object else None
            if found is not None:
                return found
        return None

    def _frame(self, i: int) -> tuple[types.FrameType, dict[str, object], _StoresByObject]:
        read = self._read[i]
        if read is None:
            frame = self._frames[i]
            stores = _stores_in(frame.f_code)
            namespace = frame_names(frame, _names_in(frame.f_code)) if stores else {}
            by_object: _StoresByObject = {}
            for n, store in enumerate(stores):
                obj = namespace.get(store[1], _ANY)
                if obj is not _ANY:
                    by_object.setdefault(id(obj), []).append((n, store, obj))
            read = self._read[i] = (frame, namespace, by_object)
        return read


def _placement_in_frame(frame: types.FrameType, namespace: dict[str, object], by_object: _StoresByObject,
                        chain: Chain, placed: object,
                        depends: Optional[list[bool]] = None) -> Optional[Site]:
    # The stores into a container of the chain, in the frame's store order, then the chain's.
    candidates = sorted((n, depth, store) for depth, (container, _) in enumerate(chain)
                        for n, store, obj in by_object.get(id(container), ()) if obj is container)
    best: Optional[tuple[tuple[int, int, int, int, int], int]] = None
    last = len(chain) - 1
    at_end = _placed_at_the_end(frame, chain, candidates, depends)
    for _, depth, (lineno, _name, key, values, _shape) in candidates:
        chain_key = chain[depth][1]
        key_score = 2 if key is not _ANY and _same_key(key, chain_key) else (1 if key is _ANY else 0)
        # Whether another tensor of the same container could get another answer: a store into
        # its own index, or one that can be a candidate (above the last step the key is every
        # such tensor's) storing a value that may be one tensor and not another.
        if depends is not None and not depends and (
                depth == last and key is not _ANY
                or key_score and any(_may_be_placed(namespace.get(v, _ANY), chain) for v in values)):
            depends.append(True)
        if key_score == 0:
            continue
        names_it = int(any(_is_on_the_way(namespace.get(v, _ANY), chain, depth, placed) for v in values))
        score = (int(lineno <= frame.f_lineno), names_it, int(lineno == at_end), key_score,
                 lineno if lineno <= frame.f_lineno else -lineno)
        if best is None or score > best[0]:
            best = (score, lineno)
    if best is None:
        return None
    filename = frame.f_code.co_filename
    line = linecache.getline(filename, best[1], frame.f_globals).strip()
    return Site(filename, best[1], frame.f_code.co_name, line)


def _placed_at_the_end(frame: types.FrameType, chain: Chain,
                       candidates: list[tuple[int, int, _Store]], depends: Optional[list[bool]]) -> Optional[int]:
    """For a tensor in a list, the line of the store that put it at its place from the list's end.

    Counted back from the frame's current line over the stores at or before it that change
    the list: `lst.append(a); lst.append(b)` put `a` second from the end, so a list that grew
    after a placement does not name the later store. An append of a size the source does not
    show is the store of every place further back, and so is the earliest store for a place
    further back than all of them (a loop's appends). A store into the middle (`insert(i, x)`,
    a slice) ends the count: None, as for a tensor not in a list (or deque).
    """
    last = len(chain) - 1
    lst, index = chain[last]
    if not isinstance(lst, (list, deque)) or type(index) is not int or not 0 <= index < len(lst):
        return None
    from_end = len(lst) - 1 - index
    changes: list[tuple[int, int]] = []  # (line, what it does at the list's end), of the stores into the list
    for _, depth, (lineno, _name, key, _values, shape) in candidates:
        if shape is None or lineno > frame.f_lineno or (key is not _ANY and not _same_key(key, chain[depth][1])):
            continue
        steps, count = shape
        if depth + steps == last - 1 and count == _WHOLE:
            changes.append((lineno, _WHOLE))  # `rd["l"] = [...]`: the list, stored whole
        elif depth + steps == last and count != _WHOLE:
            changes.append((lineno, count))  # into the list itself (`lst[3] = x`: at an index, not its end)
    found, counted, covered = None, 0, 0
    for lineno, count in sorted(changes, reverse=True):
        if count == _NOT_AT_END:
            continue
        counted += 1
        if count == _INSIDE:  # what it moved is not known: no answer from here on
            found = None
            break
        found = lineno  # past every store counted: the earliest (a loop's, as a rule)
        if count in (_WHOLE, _UNKNOWN_SIZE) or from_end < covered + count:
            break  # the store it is within, or the nearest one before those counted
        covered += count
    if found is not None and counted > 1 and depends is not None and not depends:
        depends.append(True)  # another place in the list may have another store
    return found


def _may_be_placed(value: object, chain: Chain) -> bool:
    """Whether a stored value could be one placed tensor and not another: neither nothing
    nor a container of the chain (those are the same for every tensor of a container)."""
    return value is not _ANY and not any(value is container for container, _ in chain)


def _is_on_the_way(value: object, chain: Chain, depth: int, placed: object) -> bool:
    """Whether a stored value is the placed tensor or a container below the store's own."""
    if value is _ANY:
        return False
    return value is placed or any(value is container for container, _ in chain[depth + 1:])


def _same_key(a: object, b: object) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001
        return False


# (lineno, container name, key, names of the values it stores, its shape: `_shape`)
_Store = tuple[int, str, object, tuple[str, ...], Optional[tuple[int, int]]]
# A store's shape, for a list it changes: (steps from the named container down to that list or the
# container it is stored into, and what it does at the list's end): `count` values appended, an
# append of a size the source does not show, the list stored whole, or nothing at its end.
_UNKNOWN_SIZE, _WHOLE, _NOT_AT_END, _INSIDE = 0, -1, -2, -3
_stores_cache: dict[types.CodeType, tuple[_Store, ...]] = {}
_module_cache: dict[str, Optional[ast.Module]] = {}


_names_cache: dict[types.CodeType, frozenset[str]] = {}


def _names_in(code: types.CodeType) -> frozenset[str]:
    """The names `code`'s stores read: the containers they store into and the values they store."""
    cached = _names_cache.get(code)
    if cached is None:
        cached = _names_cache[code] = frozenset(
            name for _, container, _, values, _ in _stores_in(code) for name in (container, *values))
    return cached


def _stores_in(code: types.CodeType) -> tuple[_Store, ...]:
    """`(lineno, container name, key, value names)` for each store into a named container in `code`."""
    cached = _stores_cache.get(code)
    if cached is None:
        cached = _stores_cache[code] = tuple(_find_stores(code))
    return cached


def _find_stores(code: types.CodeType) -> Iterator[_Store]:
    tree = _parse(code.co_filename)
    if tree is None:
        return
    scope: ast.AST = tree
    if code.co_name != "<module>":
        found = next((n for n in ast.walk(tree) if _defines(n, code)), None)
        if found is None:
            return
        scope = found
    for node in ast.walk(scope):
        stores = list(_stores_of(node))
        if stores:
            values, shape = _value_names(node), _shape(node)
            for lineno, name, key in stores:
                yield lineno, name, key, values, shape


def _steps(expr: ast.AST) -> int:
    """How many steps below its named container `expr` is (`rd["l"]`: 1, `lst`: 0), counted as
    `_owners` counts them (`ns.__dict__["x"]` is one step, `.x`)."""
    steps = 0
    while isinstance(expr, (ast.Subscript, ast.Attribute)):
        steps += not (isinstance(expr, ast.Attribute) and expr.attr == "__dict__")
        expr = expr.value
    return steps


def _literal_size(expr: Optional[ast.AST]) -> int:
    """How many values a list or tuple literal holds; `_UNKNOWN_SIZE` for anything else."""
    if isinstance(expr, (ast.List, ast.Tuple)) and not any(isinstance(e, ast.Starred) for e in expr.elts):
        return len(expr.elts) or _NOT_AT_END
    return _UNKNOWN_SIZE


def _shape(node: ast.AST) -> Optional[tuple[int, int]]:
    """What a store does to the end of a list (see `_Store`): `lst.append(x)` appends one value,
    `rd["l"].extend([a, b])` and `lst += [a, b]` two, `rd["l"] = [...]` stores the list whole,
    `lst.insert(0, x)` and `lst[3] = x` leave its end as it was. None: not a store into a list."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner, attr = node.func.value, node.func.attr
        if attr == "append" and len(node.args) == 1:
            return _steps(owner), 1
        if attr == "extend" and len(node.args) == 1:
            return _steps(owner), _literal_size(node.args[0])
        if attr in ("appendleft", "extendleft"):
            return _steps(owner), _NOT_AT_END
        if attr == "insert" and len(node.args) == 2:
            front = isinstance(node.args[0], ast.Constant) and node.args[0].value == 0
            return _steps(owner), _NOT_AT_END if front else _INSIDE
        return None
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
        return _steps(node.target), _literal_size(node.value)
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        if isinstance(target, ast.Subscript):
            # `rd["l"] = [...]` stores a list whole into `rd`; `lst[3] = x` stores into the list at
            # its own index, `lst[1:1] = [...]` somewhere in it
            return _steps(target.value), _INSIDE if isinstance(target.slice, ast.Slice) else _WHOLE
        if isinstance(target, ast.Attribute):
            return _steps(target.value), _WHOLE
    return None


def _value_names(node: ast.AST) -> tuple[str, ...]:
    """The plain names a store puts in: `t` in `q.appendleft(t)`, `rd["kl"] = t`, `l[0:0] = [t, u]`."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        exprs: list[Optional[ast.expr]] = [node.value]
    elif isinstance(node, ast.Call):
        exprs = [*node.args, *(kw.value for kw in node.keywords)]
    else:
        return ()
    names: list[str] = []
    while exprs:
        expr = exprs.pop()
        if isinstance(expr, ast.Name):
            names.append(expr.id)
        elif isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            exprs += expr.elts
        elif isinstance(expr, ast.Dict):
            exprs += expr.values
        elif isinstance(expr, ast.Starred):
            exprs.append(expr.value)
    return tuple(names)


def _stores_of(node: ast.AST) -> Iterator[tuple[int, str, object]]:
    """`(lineno, container name, key)` for each store one statement or call makes."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for sub in ast.walk(target):  # rd["kl"] = x, exp.kl = x, a.b, rd["c"] = x, y
                if isinstance(sub, (ast.Subscript, ast.Attribute)) and isinstance(sub.ctx, ast.Store):
                    yield from _owners(node.lineno, sub)
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            yield node.lineno, node.target.id, _ANY  # d |= {...}; lst += [...]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in _STORE_METHODS:
            yield from _method_stores(node)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
        if len(node.args) >= 2 and isinstance(node.args[0], ast.Name):
            yield node.lineno, node.args[0].id, _attr_key(node.args[1])  # setattr(exp, "kl", x)


def _owners(lineno: int, expr: ast.AST, key: object = _ANY) -> Iterator[tuple[int, str, object]]:
    """`(lineno, name, key)` for the named container an expression stores into.

    `rd["kl"] = x` and `rd["kl"].append(x)` both name `rd` with key "kl"; `lst[0] = x`
    and `lst.append(x)` name `lst`; `exp.kl = x` and `exp.info["kl"] = x` name `exp`
    with the attribute step `Attr("kl")` / `Attr("info")` (`ns.__dict__["x"]` is `.x`).
    """
    while isinstance(expr, (ast.Subscript, ast.Attribute)):
        if isinstance(expr, ast.Subscript):
            key = _constant(expr.slice)
        elif expr.attr == "__dict__":
            key = Attr(key) if isinstance(key, str) else _ANY
        else:
            key = Attr(expr.attr)
        if isinstance(expr.value, ast.Name):
            yield lineno, expr.value.id, key
        expr = expr.value
    if isinstance(expr, ast.Name) and key is _ANY:
        yield lineno, expr.id, _ANY


def _method_stores(node: ast.Call) -> Iterator[tuple[int, str, object]]:
    owner = node.func.value  # type: ignore[attr-defined]
    attr = node.func.attr  # type: ignore[attr-defined]
    if isinstance(owner, ast.Name) and attr in ("setdefault", "__setitem__", "set") and node.args:
        yield node.lineno, owner.id, _constant(node.args[0])  # td.set("kl", x) too
    elif attr == "__setattr__" and len(node.args) >= 3 and isinstance(node.args[0], ast.Name):
        yield node.lineno, node.args[0].id, _attr_key(node.args[1])  # object.__setattr__(exp, "kl", x)
    elif isinstance(owner, ast.Name) and attr == "__setattr__" and node.args:
        yield node.lineno, owner.id, _attr_key(node.args[0])  # exp.__setattr__("kl", x)
    elif isinstance(owner, ast.Name) and attr == "update" and (
            node.keywords or (node.args and isinstance(node.args[0], ast.Dict))):
        for kw in node.keywords:
            yield node.lineno, owner.id, kw.arg if kw.arg is not None else _ANY
        if node.args and isinstance(node.args[0], ast.Dict):
            for k in node.args[0].keys:
                yield node.lineno, owner.id, _constant(k) if k is not None else _ANY
    elif isinstance(owner, ast.Name):
        yield node.lineno, owner.id, _ANY
    else:
        yield from _owners(node.lineno, owner)


def _constant(node: Optional[ast.AST]) -> object:
    return node.value if isinstance(node, ast.Constant) else _ANY


def _attr_key(node: ast.AST) -> object:
    """`Attr(name)` for an attribute name spelled as a string constant, else any key."""
    name = _constant(node)
    return Attr(name) if isinstance(name, str) else _ANY


def _defines(node: ast.AST, code: types.CodeType) -> bool:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return False
    if isinstance(node, ast.Lambda):
        return node.lineno == code.co_firstlineno and code.co_name == "<lambda>"
    if node.name != code.co_name:
        return False
    # co_firstlineno is the first decorator's line when there are decorators
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return code.co_firstlineno in (node.lineno, first)


def _parse(filename: str) -> Optional[ast.Module]:
    if filename not in _module_cache:
        try:
            _module_cache[filename] = ast.parse("".join(linecache.getlines(filename)))
        except (SyntaxError, ValueError):
            _module_cache[filename] = None
    return _module_cache[filename]
