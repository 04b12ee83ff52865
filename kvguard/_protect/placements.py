"""The statement that placed a tensor into the guarded object, read from the user's source.

The latest statement at or before the frame's current line that stores into a container
that now holds the new tensor (`rollout_data["kl"] = kl`, `d.update(...)`, `lst.append(t)`,
`exp.kl = t`, `setattr(exp, "kl", t)`, `td.set("kl", t)`), in the user's frames
(`frames.user_frames`), innermost first. Stdlib only: each function's stores are parsed
from its source once.
"""

from __future__ import annotations

import ast
import linecache
import types
from collections import deque
from typing import Iterator, Optional, Sequence

from kvguard._protect.frames import Site, frame_names, parsed_source, site_of
from kvguard._protect.tree import Attr

_ANY = object()  # a key the source does not spell as a constant
# `(container, step)` from the guarded object down to a tensor, as `tree` walks it (`Leaf.chain`).
Chain = tuple[tuple[object, object], ...]
_STORE_METHODS = frozenset({"update", "setdefault", "append", "extend", "insert", "__setitem__", "__ior__",
                            "set", "__setattr__", "appendleft", "extendleft"})
_MAX_FRAMES = 12


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
    if found is not None and sum(c != _NOT_AT_END for _, c in changes) > 1 and depends is not None and not depends:
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
    tree = parsed_source(code.co_filename)
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
