"""Which handler will catch a `MutationError` that is being raised, read from the bytecode.

A blocked write raises `MutationError`; a handler that drops it unread would let the code
go on as if the write had happened, so the guard raises it again at its exit. A handler
that names the error's own class (`except kvguard.MutationError:`, `pytest.raises(
kvguard.MutationError)`, `contextlib.suppress(kvguard.MutationError)`, `assertRaises`)
expected it: it has handled it, read or not. One that catches it through a base class
(`except RuntimeError:`, `except Exception:`, a bare `except:`, `pytest.raises(
RuntimeError)`) is what the re-raise is for.

At raise time the frames are walked from the write outward. In each, the exception
table (Python 3.11+) gives the handler covering the current instruction; its code says
what it is:

- `except X:` evaluates X from the frame's names: X naming MutationError (or a subclass
  the error is an instance of) is its own class; a base class catches it broadly; any
  other class lets it pass to the next clause. A clause that re-raises (`raise`,
  `raise e`) passes it on to the handlers further out.
- a `with` block's cleanup passes it on, unless its context-manager expression mentions
  an exception class (the arguments of `pytest.raises(...)`, `suppress(...)`, or the
  attributes of a manager named directly, as `assertRaises(E, fn)` uses): then as for
  `except`.
- `finally:` passes it on, unless its body leaves (`return`, `break`, `continue`).

Anything this does not recognise (Python 3.10, which has no exception table; `except*`;
an expression it cannot evaluate) counts as "not its own class": the guard then does
what it always did (re-raise at exit unless the error was read). A manager whose
`__exit__` swallows errors without naming a class is taken to pass them on.
"""

from __future__ import annotations

import dis
import inspect
import os
import types
import weakref
from typing import Iterator, NamedTuple, Optional

from kvguard._report.events import MutationError
from kvguard._protect import frames as _frames

OWN, OTHER, PASSES = "own", "other", "passes"  # a handler's verdict, and a frame's
_MAX_FRAMES = 200
_MAX_HOPS = 64  # handlers followed inside one frame
_CACHE_SIZE = 512
_MISSING = object()

_LOAD_NAME_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF",
                            "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_DEREF", "LOAD_FROM_DICT_OR_GLOBALS",
                            "LOAD_CONST", "LOAD_FAST_BORROW", "LOAD_SMALL_INT"})
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
# What may sit between a handler's start and `CHECK_EXC_MATCH`: the class expression.
_SPEC_OPS = _LOAD_NAME_OPS | _ATTR_OPS | {"BUILD_TUPLE", "PUSH_NULL", "NOP", "EXTENDED_ARG", "CACHE"}
# A context-manager expression: names, attributes and calls.
_CM_OPS = _SPEC_OPS | {"PRECALL", "CALL", "CALL_KW", "KW_NAMES", "BUILD_LIST", "BUILD_MAP",
                       "BUILD_CONST_KEY_MAP", "LOAD_FAST_LOAD_FAST", "COPY", "SWAP"}
# A cleanup block that only tidies up (`del e`, restoring the previous exception) and re-raises.
_CLEANUP_OPS = frozenset({"COPY", "POP_EXCEPT", "LOAD_CONST", "STORE_FAST", "STORE_NAME", "STORE_DEREF",
                          "STORE_GLOBAL", "DELETE_FAST", "DELETE_NAME", "DELETE_DEREF", "DELETE_GLOBAL",
                          "POP_TOP", "SWAP", "NOP", "CALL_INTRINSIC_1", "EXTENDED_ARG", "CACHE"})
_LEAVE_OPS = frozenset({"RETURN_VALUE", "RETURN_CONST", "POP_EXCEPT"})
_WITH_OPS = frozenset({"BEFORE_WITH", "BEFORE_ASYNC_WITH"})


class _Entry(NamedTuple):
    start: int  # byte offsets, end exclusive
    end: int
    target: int


class _Code(NamedTuple):
    """What a code object's handlers need, decoded once."""

    instructions: list[dis.Instruction]
    at: dict[int, int]  # offset -> position in `instructions`
    table: list[_Entry]


# Held weakly: a code object the cache kept would outlive its function (Dynamo's transformed
# code, kept past `torch._dynamo.reset()` until interpreter exit, where torch 2.14's clean-up
# hook for it fails: "Exception ignored in ... ExactWeakKeyDictionary").
_decoded: weakref.WeakKeyDictionary[types.CodeType, Optional[_Code]] = weakref.WeakKeyDictionary()


def caught_by_its_own_class(error: BaseException, frame: Optional[types.FrameType]) -> bool:
    """Whether the first handler to catch `error`, raised now below `frame`, names its class.

    `frame` is where the walk starts (kvguard's own frames at the start are skipped).
    Never raises: an analysis that fails answers False, the guard's old rule.
    """
    try:
        return _walk(error, frame) == OWN
    except Exception:  # noqa: BLE001 - unknown bytecode: the guard keeps its old rule
        return False


def _walk(error: BaseException, frame: Optional[types.FrameType]) -> str:
    while frame is not None and frame.f_code.co_filename.startswith(_frames.PACKAGE_DIR):
        frame = frame.f_back
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return OTHER  # uncaught: it leaves the guard, which then sees it pass
        verdict = _frame_verdict(error, frame)
        if verdict != PASSES:
            return verdict
        frame = frame.f_back
    return OTHER


def _frame_verdict(error: BaseException, frame: types.FrameType) -> str:
    """OWN or OTHER for the handler in `frame` that catches `error`; PASSES when none does."""
    code = _decode(frame.f_code)
    if code is None:
        return OTHER
    offset = frame.f_lasti
    for _ in range(_MAX_HOPS):
        entry = _covering(code.table, offset)
        if entry is None:
            return PASSES
        verdict, offset = _handler_verdict(error, frame, code, entry)
        if verdict != PASSES:
            return verdict
    return OTHER


def _handler_verdict(error: BaseException, frame: types.FrameType, code: _Code, entry: _Entry) -> tuple[str, int]:
    """(verdict, offset where the error is raised again when it PASSES) for the handler at `entry`."""
    at = code.at.get(entry.target)
    if at is None:
        return OTHER, 0
    ops = code.instructions
    if ops[at].opname != "PUSH_EXC_INFO":
        return _cleanup(ops, at)
    first = at + 1
    if ops[first].opname == "WITH_EXCEPT_START":
        return _with_cleanup(error, frame, code, entry, first)
    end = _handler_end(code, ops[at].offset)
    if ops[first].opname == "POP_TOP":  # a bare `except:`, or a `finally:` that dropped the error
        reraise = _reraise_in(ops, first + 1, end, None)
        return (PASSES, ops[reraise].offset) if reraise is not None else (OTHER, 0)
    if _clause_at(ops, first) is None:
        return _finally(ops, first, end)
    return _except_clauses(error, frame, ops, code, first)


def _except_clauses(error: BaseException, frame: types.FrameType, ops: list[dis.Instruction], code: _Code,
                    at: int) -> tuple[str, int]:
    """`except A: ... except B: ...`, tried in order as Python does."""
    for _ in range(_MAX_HOPS):
        clause = _clause_at(ops, at)
        if clause is None:  # past the last clause: `RERAISE` of an error no clause matched
            return (PASSES, ops[at].offset) if ops[at].opname == "RERAISE" else (OTHER, 0)
        check, jump = clause
        if ops[check].opname != "CHECK_EXC_MATCH":
            return OTHER, 0  # `except*`
        kind = _match(error, _values(frame, ops[at:check]), strict=True)
        next_clause = code.at.get(_jump_target(ops[jump]))
        if kind is None:
            return OTHER, 0
        if kind != PASSES:
            reraise = _reraise_in(ops, jump + 1, next_clause if next_clause is not None else len(ops),
                                  _bound_name(ops, jump + 1))
            return (PASSES, ops[reraise].offset) if reraise is not None else (kind, 0)
        if next_clause is None:
            return OTHER, 0
        at = next_clause
    return OTHER, 0


def _clause_at(ops: list[dis.Instruction], at: int) -> Optional[tuple[int, int]]:
    """(position of CHECK_EXC_MATCH, of the jump after it) when an `except X:` clause starts at `at`."""
    i = at
    while i < len(ops) and ops[i].opname in _SPEC_OPS:
        i += 1
    if i == at or i + 1 >= len(ops) or ops[i].opname not in ("CHECK_EXC_MATCH", "CHECK_EG_MATCH"):
        return None
    if "JUMP" not in ops[i + 1].opname:
        return None
    return i, i + 1


def _match(error: BaseException, values: list[object], strict: bool) -> Optional[str]:
    """OWN when a class in `values` that catches `error` names MutationError, OTHER when only a
    base class catches it, PASSES when none does; None when a value is unknown (and `strict`)."""
    classes = list(_classes(values))
    catching = [c for c in classes if isinstance(error, c)]
    if any(issubclass(c, MutationError) for c in catching):
        return OWN
    if catching:
        return OTHER
    if strict and (not values or any(v is _MISSING or not _is_spec(v) for v in values)):
        return None
    return PASSES


def _classes(values: list[object]) -> Iterator[type]:
    for value in values:
        if isinstance(value, tuple):
            yield from _classes(list(value))
        elif isinstance(value, type) and issubclass(value, BaseException):
            yield value


def _is_spec(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_is_spec(v) for v in value)
    return isinstance(value, type) and issubclass(value, BaseException)


def _with_cleanup(error: BaseException, frame: types.FrameType, code: _Code, entry: _Entry,
                  at: int) -> tuple[str, int]:
    """A `with` block's `__exit__`: its manager decides, when its expression names a class."""
    ops = code.instructions
    reraise = next((i for i in range(at, len(ops)) if ops[i].opname == "RERAISE"), None)
    if reraise is None:
        return OTHER, 0
    kind = _match(error, _manager_values(frame, code, entry), strict=False)
    if kind in (OWN, OTHER):
        return str(kind), 0
    return PASSES, ops[reraise].offset


def _manager_values(frame: types.FrameType, code: _Code, entry: _Entry) -> list[object]:
    """What the `with` statement's expression mentions: its names, attributes and call
    arguments; for a manager named directly (`with ctx:`), also what its attributes hold."""
    start = min(e.start for e in code.table if e.target == entry.target)
    ops = code.instructions
    before = [i for i, op in enumerate(ops) if op.opname in _WITH_OPS and op.offset < start]
    if not before:
        return []
    end = before[-1]
    first = end
    while first > 0 and ops[first - 1].opname in _CM_OPS:
        first -= 1
    window = ops[first:end]
    values = _values(frame, window)
    if len(values) == 1 and not any(op.opname in ("CALL", "PRECALL", "CALL_KW") for op in window):
        held = getattr(values[0], "__dict__", None)
        if isinstance(held, dict) and not isinstance(values[0], type):
            values += list(held.values())
    return values


def _finally(ops: list[dis.Instruction], at: int, end: int) -> tuple[str, int]:
    """A `finally:` body re-raises at its end, unless it leaves first."""
    for i in range(at, end):
        name = ops[i].opname
        if name in _LEAVE_OPS:
            return OTHER, 0
        if name == "RERAISE":
            return PASSES, ops[i].offset
    return OTHER, 0


def _cleanup(ops: list[dis.Instruction], at: int) -> tuple[str, int]:
    for i in range(at, len(ops)):
        if ops[i].opname == "RERAISE":
            return PASSES, ops[i].offset
        if ops[i].opname not in _CLEANUP_OPS:
            return OTHER, 0
    return OTHER, 0


def _handler_end(code: _Code, start: int) -> int:
    """Where a handler's code ends: at the cleanup block its own exception-table entry names."""
    entry = _covering(code.table, start)
    if entry is None or entry.target <= start:
        return len(code.instructions)
    return code.at.get(entry.target, len(code.instructions))


def _reraise_in(ops: list[dis.Instruction], start: int, end: int, bound: Optional[str]) -> Optional[int]:
    """The position of a `raise` (or `raise <bound name>`) between `start` and `end`, if any."""
    for i in range(start, min(end, len(ops))):
        if ops[i].opname != "RAISE_VARARGS":
            continue
        if ops[i].arg == 0:
            return i
        if ops[i].arg == 1 and bound is not None and ops[i - 1].opname in _LOAD_NAME_OPS \
                and ops[i - 1].argval == bound:
            return i
    return None


def _bound_name(ops: list[dis.Instruction], at: int) -> Optional[str]:
    """The name of `except X as name:`, stored right after the clause matched."""
    if at < len(ops) and ops[at].opname.startswith("STORE_"):
        return str(ops[at].argval)
    return None


def _jump_target(op: dis.Instruction) -> int:
    return int(op.argval) if isinstance(op.argval, int) else -1


def _values(frame: types.FrameType, window: list[dis.Instruction]) -> list[object]:
    """The values of the name-and-attribute chains in `window` (`kvguard.MutationError`), in order.

    Attributes are read with `inspect.getattr_static`: no property, module `__getattr__`
    or descriptor of the user's runs. A chain that cannot be read is `_MISSING`.
    """
    values: list[object] = []
    namespace: Optional[dict[str, object]] = None
    for op in window:
        name = op.opname
        if name in _LOAD_NAME_OPS:
            if name == "LOAD_CONST" or name == "LOAD_SMALL_INT":
                values.append(op.argval)
                continue
            if name in ("LOAD_GLOBAL", "LOAD_FROM_DICT_OR_GLOBALS"):
                values.append(_global(frame, str(op.argval)))
                continue
            if namespace is None:
                namespace = _frames.frame_namespace(frame)
            found = namespace.get(str(op.argval), _MISSING)
            values.append(_global(frame, str(op.argval)) if found is _MISSING else found)
        elif name == "LOAD_FAST_LOAD_FAST":
            if namespace is None:
                namespace = _frames.frame_namespace(frame)
            values += [namespace.get(str(n), _MISSING) for n in op.argval]
        elif name in _ATTR_OPS and values:
            values[-1] = _attribute(values[-1], str(op.argval))
    return values


def _global(frame: types.FrameType, name: str) -> object:
    if name in frame.f_globals:
        return frame.f_globals[name]
    return frame.f_builtins.get(name, _MISSING)


def _attribute(value: object, name: str) -> object:
    if value is _MISSING:
        return _MISSING
    try:
        found = inspect.getattr_static(value, name, _MISSING)
    except Exception:  # noqa: BLE001 - an object whose type lookup fails
        return _MISSING
    if isinstance(found, (staticmethod, classmethod)):
        return found.__func__
    return found


def _covering(table: list[_Entry], offset: int) -> Optional[_Entry]:
    for entry in table:
        if entry.start <= offset < entry.end:
            return entry
    return None


def _decode(code: types.CodeType) -> Optional[_Code]:
    if code in _decoded:
        return _decoded[code]
    raw = getattr(code, "co_exceptiontable", None)
    decoded = None
    if raw is not None:  # Python 3.10 has no exception table: nothing to read
        instructions = list(dis.get_instructions(code))
        decoded = _Code(instructions, {op.offset: i for i, op in enumerate(instructions)},
                        list(parse_exception_table(raw)))
    if len(_decoded) >= _CACHE_SIZE:
        _decoded.clear()
    _decoded[code] = decoded
    return decoded


def parse_exception_table(raw: bytes) -> Iterator[_Entry]:
    """The entries of a 3.11+ `co_exceptiontable` (see CPython's exception_handling_notes.txt):
    varints of 6-bit chunks, the first chunk of each entry flagged by bit 7; in code units."""
    chunks = iter(raw)

    def varint(first: int) -> int:
        value, byte = first & 63, first
        while byte & 64:
            byte = next(chunks)
            value = (value << 6) | (byte & 63)
        return value

    for first in chunks:
        start = varint(first)
        length = varint(next(chunks))
        target = varint(next(chunks))
        varint(next(chunks))  # depth and lasti: not needed to find the handler
        yield _Entry(start * 2, (start + length) * 2, target * 2)
