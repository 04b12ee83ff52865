"""What the code running in a frame may still read: local variables live at its current instruction.

A view of a receive buffer is *held* at a refill when code may still read it: a variable
the running code reads again before it rebinds it, or a container such a variable holds.
A loop variable left over from a finished loop (`for name, w in weights: ...`), or one the
next iteration rebinds first, is dead there: the view it still references is garbage
waiting to be collected, not a use. Liveness is read from the bytecode (a backward
data-flow over the instructions, with the exception table's handlers as successors),
once per code object, and asked per frame at its `f_lasti`.

Also here, `collects`: whether the code asking an iterator for its next item keeps what
it was given (`dict(weights)`, a comprehension) or takes one at a time (a `for` loop).
"""

from __future__ import annotations

import ast
import dis
import functools
import inspect
import types
from typing import Callable, Optional

# Opcodes by what they do to local (fast) variables; the two-name forms are Python 3.13's.
_USES = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST",
                   "LOAD_FAST_BORROW", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
_DEFS = frozenset({"STORE_FAST", "DELETE_FAST", "STORE_FAST_STORE_FAST"})
_NAME_USES = frozenset({"LOAD_NAME", "LOAD_GLOBAL", "LOAD_FROM_DICT_OR_GLOBALS"})
_NAME_DEFS = frozenset({"STORE_NAME", "DELETE_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})
# Instructions after which execution does not fall through to the next one.
_NO_FALLTHROUGH = frozenset({"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE", "JUMP_FORWARD",
                             "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE", "JUMP",
                             "JUMP_NO_INTERRUPT"})
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
# Names that read a frame's locals by name: every local is live where code may call them.
_INTROSPECTIVE = frozenset({"locals", "vars", "eval", "exec", "dir"})
# What a call that consumes an iterator whole is called: it keeps every item it takes.
COLLECTORS = frozenset({"dict", "list", "tuple", "set", "frozenset", "sorted", "OrderedDict", "deque",
                        "defaultdict"})
_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>"})
_BUILDS = frozenset({"LIST_APPEND", "MAP_ADD", "SET_ADD"})


class _Liveness:
    """One code object's instructions, by offset, and the names live after each."""

    __slots__ = ("offsets", "live_out", "names", "always", "_at")

    def __init__(self, offsets: list[int], live_out: list[int], names: list[str], always: int) -> None:
        self.offsets = offsets  # each instruction's offset, ascending
        self.live_out = live_out  # per instruction: the bit set of names live after it runs
        self.names = names  # bit i -> name
        self.always = always  # names live everywhere (cells, names nested code reads)
        self._at: dict[int, frozenset[str]] = {}  # answers by offset

    def at(self, lasti: int) -> frozenset[str]:
        """The names live once the instruction at byte offset `lasti` completes."""
        known = self._at.get(lasti)
        if known is None:
            i = _index_at(self.offsets, lasti)
            bits = (self.live_out[i] if i >= 0 else 0) | self.always
            known = self._at[lasti] = frozenset(name for k, name in enumerate(self.names) if bits >> k & 1)
        return known


def live_names(frame: types.FrameType) -> Optional[frozenset[str]]:
    """The variables of `frame` that its code may still read from its current instruction on
    (for a module's frame, its globals; nested functions and classes may read those at any
    time). None: not known (a frame calling `locals()`, bytecode this cannot read): every
    variable counts as live."""
    try:
        analysis = _analyse(frame.f_code, _is_module(frame))
    except Exception:  # noqa: BLE001 - bytecode of a shape not read here: every name is live
        return None
    return None if analysis is None else analysis.at(frame.f_lasti)


def _is_module(frame: types.FrameType) -> bool:
    """Whether `frame` runs a module's (or a class body's) code: its variables are names, not fast locals."""
    return not frame.f_code.co_flags & inspect.CO_OPTIMIZED


@functools.lru_cache(maxsize=1024)
def _analyse(code: types.CodeType, module: bool) -> Optional[_Liveness]:
    if _INTROSPECTIVE & set(code.co_names):
        return None
    instructions = list(dis.get_instructions(code))
    if not instructions:
        return None
    uses_ops, defs_ops = (_NAME_USES, _NAME_DEFS) if module else (_USES, _DEFS)
    index: dict[str, int] = {}

    def bit(name: str) -> int:
        return 1 << index.setdefault(name, len(index))

    offsets = [ins.offset for ins in instructions]
    at_offset = {offset: i for i, offset in enumerate(offsets)}
    uses: list[int] = []
    defs: list[int] = []
    successors: list[list[int]] = []
    for i, ins in enumerate(instructions):
        use = kill = 0
        names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
        if ins.opname == "STORE_FAST_LOAD_FAST" and not module:  # stores one, then loads one
            kill = bit(str(names[0]))
            use = bit(str(names[1])) if names[1] != names[0] else 0
        elif ins.opname in uses_ops:
            for name in names:
                use |= bit(str(name))
        elif ins.opname in defs_ops:
            for name in names:
                kill |= bit(str(name))
        uses.append(use)
        defs.append(kill)
        nexts = [] if ins.opname in _NO_FALLTHROUGH or i + 1 == len(instructions) else [i + 1]
        if ins.opcode in _JUMPS and isinstance(ins.argval, int) and ins.argval in at_offset:
            nexts.append(at_offset[ins.argval])
        successors.append(nexts)
    for entry in getattr(dis.Bytecode(code), "exception_entries", ()):  # a handler follows each instruction it covers
        target = at_offset.get(entry.target)
        if target is None:
            continue
        for i, offset in enumerate(offsets):
            if entry.start <= offset < entry.end:
                successors[i].append(target)
    always = 0
    for name in (*code.co_cellvars, *code.co_freevars):
        always |= bit(name)
    if module:
        for name in _read_by_nested(code):
            always |= bit(name)
    live_in = [0] * len(instructions)
    live_out = [0] * len(instructions)
    changed = True
    while changed:  # backward, to a fixpoint
        changed = False
        for i in range(len(instructions) - 1, -1, -1):
            out = 0
            for j in successors[i]:
                out |= live_in[j]
            new_in = uses[i] | (out & ~defs[i])
            if out != live_out[i] or new_in != live_in[i]:
                live_out[i], live_in[i], changed = out, new_in, True
    by_bit = [""] * len(index)
    for name, k in index.items():
        by_bit[k] = name
    return _Liveness(offsets, live_out, by_bit, always)


def _read_by_nested(code: types.CodeType) -> set[str]:
    """The global names the functions and classes defined in `code` read (at any time they run)."""
    found: set[str] = set()
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.update(const.co_names)
            found |= _read_by_nested(const)
    return found


def _index_at(offsets: list[int], lasti: int) -> int:
    """The index of the instruction at (or last before) byte offset `lasti`."""
    lo, hi = 0, len(offsets)
    while lo < hi:
        mid = (lo + hi) // 2
        if offsets[mid] <= lasti:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


def callee(frame: types.FrameType) -> Optional[str]:
    """The name of the function the innermost call at `frame`'s instruction names (`dict` in
    `weights = dict(self._stream())`), read from the source; None where it cannot be read."""
    return _callee_at(frame.f_code, frame.f_lasti)


@functools.lru_cache(maxsize=4096)
def _callee_at(code: types.CodeType, lasti: int) -> Optional[str]:
    from kvguard._protect.frames import parsed_source

    positions = list(code.co_positions())
    if lasti < 0 or lasti // 2 >= len(positions):
        return None
    line, end_line, col, end_col = positions[lasti // 2]
    tree = parsed_source(code.co_filename)
    if tree is None or line is None or col is None or end_line is None or end_col is None:
        return None
    best: Optional[ast.Call] = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.end_lineno is not None and node.end_col_offset is not None \
                and (node.lineno, node.col_offset) <= (line, col) and (end_line, end_col) <= \
                (node.end_lineno, node.end_col_offset):
            if best is None or (best.lineno, best.col_offset) <= (node.lineno, node.col_offset):
                best = node  # the innermost call holding the instruction
    func = best.func if best is not None else None
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def collects(frame: types.FrameType, collector: Callable[[], bool]) -> bool:
    """Whether the code in `frame`, asking an iterator for its next item, keeps every item it takes
    (`dict(weights)`, `list(...)`, a list, dict or set comprehension) rather than taking one at a
    time (a `for` loop, `next()`, a generator passing them on). `collector()`: whether the call the
    frame is making is to one of `COLLECTORS`, asked only where its instruction is a call."""
    code = frame.f_code
    if code.co_name in _COMPREHENSIONS:
        return True
    try:
        kind = _consumer(code, frame.f_lasti)
    except Exception:  # noqa: BLE001 - not read: taken as a loop
        return False
    return collector() if kind == "call" else kind == "builds"


@functools.lru_cache(maxsize=4096)
def _consumer(code: types.CodeType, lasti: int) -> str:
    """What the instruction at `lasti` is, as an iterator's consumer: "call", "builds" (a loop whose
    body appends each item to what it builds: an inlined comprehension), or "loop"."""
    instructions = list(dis.get_instructions(code))
    i = _index_at([ins.offset for ins in instructions], lasti)
    if i < 0:
        return "loop"
    current = instructions[i]
    if current.opname.startswith(("CALL", "PRECALL")):
        return "call"
    if current.opname == "FOR_ITER" and isinstance(current.argval, int):  # a comprehension inlined (3.12+)
        if any(ins.opname in _BUILDS for ins in instructions[i + 1:] if ins.offset < current.argval):
            return "builds"
    return "loop"
