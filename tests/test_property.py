"""Property test: kvguard reports a write exactly when it touches protected memory.

Hypothesis draws short programs over a small universe of tensors: protected and
unprotected float32 bases, a complex64 base, and protected entries that are views of one
shared base (row and column split chunks, interleaved `[:, ::2]` / `[:, 1::2]` halves, an
`unbind` row, a 0-d element, a strided uint8 view, a numpy alias of a row, an empty slice,
the imaginary halves of the complex base) whose siblings stay unprotected. Each step builds
a target by a chain of views (slices, select, transpose, split / chunk / unbind, strides,
dtype views, numpy aliases, `.data`, `.detach()`, `.real` / `.imag` / `.conj()`,
`view_as_real`, and `reshape` / `contiguous`, which may copy) and applies one op to it:
in-place, `copy_`, `out=`, `t[mask] = 0`, `t[i] += 1`, `_foreach_add_`, or an out-of-place
op. Views and ops that raise for the drawn shapes are dropped by a dry run without a guard.

The oracle is independent of kvguard: it turns every tensor into the set of absolute byte
addresses its elements cover (data_ptr, sizes, strides, element_size, in plain Python) and
says a step writes a protected entry iff the bytes the step's op writes intersect that
entry's bytes. Events are mapped to steps by the growth of `g.report.events` across each
step. Every step must produce exactly the oracle's set of paths: no miss, no false alarm.

Set KVGUARD_HYPOTHESIS_EXAMPLES to change the number of examples for a local run.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvguard

MAX_EXAMPLES = 500
EXAMPLES = int(os.environ.get("KVGUARD_HYPOTHESIS_EXAMPLES", MAX_EXAMPLES))


# ---------------------------------------------------------------------------------------
# The oracle: exact byte sets, in plain Python (no torch op, no kvguard code)


def byte_set_meta(ptr: int, sizes: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> frozenset[int]:
    """Absolute addresses of every byte of every element of a strided layout."""
    if any(n == 0 for n in sizes):
        return frozenset()
    out: set[int] = set()
    for idx in itertools.product(*(range(n) for n in sizes)):
        start = ptr + sum(i * s for i, s in zip(idx, strides)) * itemsize
        out.update(range(start, start + itemsize))
    return frozenset(out)


def byte_set(t: torch.Tensor) -> frozenset[int]:
    return byte_set_meta(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())


def select_byte_set(t: torch.Tensor, i: int) -> frozenset[int]:
    """Bytes of `t[i]`, computed from `t`'s metadata alone."""
    n = t.shape[0]
    i = i + n if i < 0 else i
    assert 0 <= i < n
    ptr = t.data_ptr() + i * t.stride(0) * t.element_size()
    return byte_set_meta(ptr, tuple(t.shape[1:]), tuple(t.stride()[1:]), t.element_size())


def hit_paths(written: frozenset[int], protected: dict[str, frozenset[int]]) -> set[str]:
    return {path for path, bytes_ in protected.items() if bytes_ & written}


# ---------------------------------------------------------------------------------------
# The universe: bases and protected candidates


@dataclass(frozen=True)
class Universe:
    n1: int  # P1, U1: 1-D
    r2: int  # P2, U2: r2 x c2
    c2: int
    rs: int  # S, the shared base: rs x cs
    cs: int
    rsplit: int  # torch.split(S, rsplit, dim=0)
    csplit: int  # torch.split(S, csplit, dim=1)
    protected: tuple[str, ...]  # names put in the guarded dict


# The bases, then the candidate entries of the guarded dict, each an expression over the
# names defined before it (evaluated, so that the failure message shows the exact code).
BASES: dict[str, str] = {
    "P1": "torch.arange({n1}, dtype=torch.float32) + 1",
    "U1": "torch.arange({n1}, dtype=torch.float32) + 100",
    "P2": "torch.arange({r2} * {c2}, dtype=torch.float32).reshape({r2}, {c2}) + 1",
    "U2": "torch.arange({r2} * {c2}, dtype=torch.float32).reshape({r2}, {c2}) + 100",
    "S": "torch.arange({rs} * {cs}, dtype=torch.float32).reshape({rs}, {cs}) + 1",
    "C": "torch.complex(P2, -P2)",  # complex64: 8-byte elements, real and imag interleaved
}
CANDIDATES: dict[str, str] = {
    "P1": "P1",
    "P2": "P2",
    "S": "S",
    "C": "C",
    "Sr0": "torch.split(S, {rsplit}, dim=0)[0]",  # row chunks: disjoint
    "Sr1": "torch.split(S, {rsplit}, dim=0)[1]",
    "Sc0": "torch.split(S, {csplit}, dim=1)[0]",  # column chunks: interleaved
    "Sc1": "torch.split(S, {csplit}, dim=1)[1]",
    "Se": "S[:, ::2]",  # strided halves: interleaved
    "So": "S[:, 1::2]",
    "Su": "S.unbind(0)[-1]",
    "S0": "S[0, -1]",  # 0-d
    "Sn": "torch.from_numpy(S.numpy()[-1])",  # another storage object over S's last row
    "Sb": "S[:, 1:].view(torch.uint8)",  # 1-byte elements, strided
    "Ci": "torch.view_as_real(C)[..., 1]",  # the imaginary halves of C's elements
    "E": "S[1:1]",  # empty: no element, so nothing can overlap it
}
SOURCES = ("U1", "U2", *CANDIDATES)


def _code(u: Universe) -> list[tuple[str, str]]:
    fields = dataclasses.asdict(u)
    return [(name, expr.format(**fields)) for name, expr in [*BASES.items(), *CANDIDATES.items()]
            if expr != name]


def build_universe(u: Universe) -> dict[str, torch.Tensor]:
    env: dict[str, Any] = {"torch": torch}
    for name, code in _code(u):
        env[name] = eval(code, env)  # noqa: S307 - our own expressions
    return {k: v for k, v in env.items() if isinstance(v, torch.Tensor)}


def render_universe(u: Universe) -> list[str]:
    lines = [f"{name} = {code}" for name, code in _code(u)]
    lines.append("d = {" + ", ".join(f"{k!r}: {k}" for k in u.protected) + "}")
    return lines


# ---------------------------------------------------------------------------------------
# Views: a transform is a tuple (name, *int args); VIEWS maps the name to
# (fn(t, *args) -> view, code shown in failure messages)


def _slice(t: torch.Tensor, dim: int, a: int, b: int, s: int) -> torch.Tensor:
    return t[a:b:s] if dim == 0 else t[:, a:b:s]


def _split(t: torch.Tensor, dim: int, size: int, i: int) -> torch.Tensor:
    parts = torch.split(t, size, dim=dim)
    return parts[i % len(parts)]


def _chunk(t: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    parts = t.chunk(n, dim)
    return parts[i % len(parts)]


def _unbind(t: torch.Tensor, dim: int, i: int) -> torch.Tensor:
    parts = t.unbind(dim)
    return parts[i % len(parts)]


def _select(t: torch.Tensor, dim: int, i: int) -> torch.Tensor:
    return t.select(dim, i % t.shape[dim])


VIEWS: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    "slice": (_slice, ""),  # rendered by render_view
    "select": (_select, "t = t.select({0}, {1} % t.shape[{0}])"),
    "T": (lambda t: t.t(), "t = t.t()"),
    "split": (_split, "t = torch.split(t, {1}, dim={0})[{2} % n]"),
    "chunk": (_chunk, "t = t.chunk({1}, {0})[{2} % n]"),
    "unbind": (_unbind, "t = t.unbind({0})[{1} % n]"),
    "even": (lambda t, dim: t[::2] if dim == 0 else t[:, ::2], ""),  # rendered by render_view
    "odd": (lambda t, dim: t[1::2] if dim == 0 else t[:, 1::2], ""),
    "i32": (lambda t: t.view(torch.int32), "t = t.view(torch.int32)"),
    "u8": (lambda t: t.view(torch.uint8), "t = t.view(torch.uint8)"),
    "f32": (lambda t: t.view(torch.float32), "t = t.view(torch.float32)"),
    "np": (lambda t: torch.from_numpy(t.numpy()), "t = torch.from_numpy(t.numpy())"),
    "c64": (lambda t: t.view(torch.complex64), "t = t.view(torch.complex64)"),
    "vreal": (lambda t: torch.view_as_real(t), "t = torch.view_as_real(t)"),
    "real": (lambda t: t.real, "t = t.real"),
    "imag": (lambda t: t.imag, "t = t.imag"),
    "conj": (lambda t: t.conj(), "t = t.conj()  # a lazy conjugate view"),
    "data": (lambda t: t.data, "t = t.data"),
    "detach": (lambda t: t.detach(), "t = t.detach()"),
    "flat": (lambda t: t.reshape(-1), "t = t.reshape(-1)  # a copy when not viewable"),
    "contig": (lambda t: t.contiguous(), "t = t.contiguous()  # a copy when strided"),
}


def apply_view(t: torch.Tensor, view: tuple[Any, ...]) -> torch.Tensor:
    return VIEWS[view[0]][0](t, *view[1:])


def render_view(view: tuple[Any, ...]) -> str:
    name, args = view[0], view[1:]
    if name == "slice":
        dim, a, b, s = args
        return f"t = t[{a}:{b}:{s}]" if dim == 0 else f"t = t[:, {a}:{b}:{s}]"
    if name in ("even", "odd"):
        sl = "::2" if name == "even" else "1::2"
        return f"t = t[{sl}]" if args[0] == 0 else f"t = t[:, {sl}]"
    return VIEWS[name][1].format(*args)


# ---------------------------------------------------------------------------------------
# Ops: name -> (fn(targets, i), code shown in failure messages). `written_bytes` is the
# oracle's view of what each one writes.


def _mask(t: torch.Tensor) -> torch.Tensor:
    return (torch.arange(t.numel()) % 2 == 0).reshape(t.shape)


def _op_aug(ts: list[torch.Tensor], i: int) -> None:
    t = ts[0]
    t[i] += 1  # select, add_ on the 0-d / row view, select, copy_ onto itself


def _op_mask(ts: list[torch.Tensor], i: int) -> None:
    t = ts[0]
    t[_mask(t)] = 0


OPS: dict[str, tuple[Callable[[list[torch.Tensor], int], Any], str]] = {
    # in-place: write the whole first target
    "mul_": (lambda ts, i: ts[0].mul_(2), "t.mul_(2)"),
    "add_": (lambda ts, i: ts[0].add_(1), "t.add_(1)"),
    "zero_": (lambda ts, i: ts[0].zero_(), "t.zero_()"),
    "fill_": (lambda ts, i: ts[0].fill_(3), "t.fill_(3)"),
    "clamp_": (lambda ts, i: ts[0].clamp_(0, 1), "t.clamp_(0, 1)"),
    "copy_": (
        lambda ts, i: ts[0].copy_(torch.full(ts[0].shape, 2, dtype=ts[0].dtype)),
        "t.copy_(torch.full(t.shape, 2, dtype=t.dtype))",
    ),
    # copying a tensor onto its own memory: a no-op for real dtypes (a self-copy, which
    # kvguard drops by design), a real write for complex ones
    "copy_conj": (lambda ts, i: ts[0].copy_(ts[0].conj()), "t.copy_(t.conj())"),
    "mask": (_op_mask, "t[(torch.arange(t.numel()) % 2 == 0).reshape(t.shape)] = 0"),
    "out": (
        lambda ts, i: torch.add(torch.ones_like(ts[0]), torch.ones_like(ts[0]), out=ts[0]),
        "torch.add(torch.ones_like(t), torch.ones_like(t), out=t)",
    ),
    # writes only t[i]
    "aug": (_op_aug, "t[{i}] += 1"),
    # writes every target
    "foreach": (lambda ts, i: torch._foreach_add_(ts, 1), "torch._foreach_add_([{ts}], 1)"),
    # out-of-place: never a write to the targets
    "oop_mul": (lambda ts, i: ts[0] * 2, "t * 2"),
    "oop_add": (lambda ts, i: torch.add(ts[0], 1), "torch.add(t, 1)"),
    "oop_clamp": (lambda ts, i: ts[0].clamp(0, 1), "t.clamp(0, 1)"),
}


def written_bytes(op: str, ts: list[torch.Tensor], i: int) -> frozenset[int]:
    """The oracle's write set of one step, from its targets' metadata."""
    if op.startswith("oop_"):
        return frozenset()
    if op == "aug":
        return select_byte_set(ts[0], i)
    if op == "copy_conj" and not ts[0].is_complex():
        return frozenset()
    if op == "foreach":
        return frozenset().union(*(byte_set(t) for t in ts))
    return byte_set(ts[0])


# ---------------------------------------------------------------------------------------
# Programs

Target = tuple[str, tuple[tuple[Any, ...], ...]]  # (source name, view chain)


@dataclass(frozen=True)
class Step:
    targets: tuple[Target, ...]
    op: str
    i: int = 0


@dataclass(frozen=True)
class Program:
    universe: Universe
    steps: tuple[Step, ...]


def build_target(env: dict[str, torch.Tensor], target: Target) -> torch.Tensor:
    src, chain = target
    t = env[src]
    for view in chain:
        t = apply_view(t, view)
    return t


def resolve(prog: Program) -> Program:
    """Drop the views and steps that raise, by running the program once without a guard.

    Only shapes, strides and dtypes decide whether a view or an op is valid, so a dry run
    on an identical universe tells which parts of the drawn program are meaningful.
    """
    env = build_universe(prog.universe)
    steps = []
    for step in prog.steps:
        targets = []
        for src, chain in step.targets:
            t, kept = env[src], []
            for view in chain:
                try:
                    t = apply_view(t, view)
                except Exception:  # noqa: BLE001 - an invalid view for this shape
                    continue
                kept.append(view)
            targets.append((src, tuple(kept)))
        try:
            OPS[step.op][0]([build_target(env, tg) for tg in targets], step.i)
        except Exception:  # noqa: BLE001 - an invalid op for this target
            continue
        steps.append(Step(tuple(targets), step.op, step.i))
    return Program(prog.universe, tuple(steps))


def render_step(k: int, step: Step) -> str:
    parts = []
    for j, (src, chain) in enumerate(step.targets):
        if step.op != "foreach" and j > 0:
            break
        name = "t" if step.op != "foreach" else f"t{j}"
        code = "; ".join([f"t = {src}", *(render_view(v) for v in chain)])
        parts.append(code + (f"; {name} = t" if name != "t" else ""))
    op = OPS[step.op][1].format(i=step.i, ts=", ".join(f"t{j}" for j in range(len(step.targets))))
    return f"step {k}: " + "; ".join(parts) + f"; {op}"


def render(prog: Program) -> str:
    return "\n".join([*render_universe(prog.universe), *(render_step(k, s) for k, s in enumerate(prog.steps))])


def protected_bytes(prog: Program, env: dict[str, torch.Tensor]) -> dict[str, frozenset[int]]:
    return {f"d[{name!r}]": byte_set(env[name]) for name in prog.universe.protected}


def run_guarded(prog: Program) -> list[str]:
    """Run a resolved program under the guard; return one line per disagreement."""
    env = build_universe(prog.universe)
    d = {name: env[name] for name in prog.universe.protected}
    protected = protected_bytes(prog, env)
    problems: list[str] = []
    with kvguard.guard(d, name="d", action="record") as g:
        events = g.report.events
        for k, step in enumerate(prog.steps):
            before = len(events)
            ts = [build_target(env, tg) for tg in step.targets]
            expected = hit_paths(written_bytes(step.op, ts, step.i), protected)
            OPS[step.op][0](ts, step.i)
            got = events[before:]
            got_paths = {ev.path for ev in got}
            # One event per entry hit; a foreach over aliasing targets may hit an entry twice.
            max_count = len(expected) * (len(ts) if step.op == "foreach" else 1)
            if got_paths != expected or not len(expected) <= len(got) <= max_count:
                problems.append(
                    f"step {k}: expected {sorted(expected)}, got "
                    f"{[(ev.path, ev.op, ev.kind) for ev in got]}"
                )
            elif any(ev.kind != "write" for ev in got):
                problems.append(f"step {k}: non-write kinds {[(ev.path, ev.op, ev.kind) for ev in got]}")
        during = len(events)
    extra = g.report.events[during:]
    if extra:
        problems.append(f"at guard exit: {[(ev.path, ev.op, ev.kind) for ev in extra]}")
    return problems


# ---------------------------------------------------------------------------------------
# Strategies

small = st.integers(0, 3)
dims = st.integers(0, 1)
views = st.one_of(
    st.tuples(st.just("slice"), dims, st.integers(0, 2), st.integers(0, 5), st.integers(1, 2)),
    st.tuples(st.just("select"), dims, small),
    st.tuples(st.just("split"), dims, st.integers(1, 3), small),
    st.tuples(st.just("chunk"), dims, st.integers(2, 3), small),
    st.tuples(st.just("unbind"), dims, small),
    st.tuples(st.sampled_from(["even", "odd"]), dims),
    *(st.just((name,)) for name in [
        "T", "i32", "u8", "f32", "np", "data", "detach", "flat", "contig", "c64", "vreal", "real", "imag", "conj",
    ]),
)


@st.composite
def universes(draw: Any) -> Universe:
    rs, cs = draw(st.integers(2, 4)), draw(st.integers(2, 6))
    protected = draw(st.lists(st.sampled_from(list(CANDIDATES)), min_size=1, max_size=5, unique=True))
    return Universe(
        n1=draw(st.integers(1, 6)),
        r2=draw(st.integers(1, 4)),
        c2=draw(st.integers(1, 5)),
        rs=rs,
        cs=cs,
        rsplit=draw(st.integers(1, rs - 1)),
        csplit=draw(st.integers(1, cs - 1)),
        protected=tuple(protected),
    )


@st.composite
def steps(draw: Any, protected: tuple[str, ...]) -> Step:
    # Half of the targets start from a protected entry, so that the interesting cases
    # (siblings, aliases, sub-views of protected entries) come up often.
    sources = st.one_of(st.sampled_from(protected), st.sampled_from(SOURCES))
    targets = st.tuples(sources, st.lists(views, max_size=3).map(tuple))
    op = draw(st.sampled_from(list(OPS)))
    n = draw(st.integers(1, 3)) if op == "foreach" else 1
    return Step(tuple(draw(targets) for _ in range(n)), op, draw(st.integers(-2, 3)))


@st.composite
def programs(draw: Any) -> Program:
    u = draw(universes())
    return Program(u, tuple(draw(st.lists(steps(u.protected), min_size=1, max_size=8))))


# Hand-made programs that always run (explicit examples): the sibling and alias cases of
# /work/shared/notes/torch-mutation-channels.md §4-5, and the bugs this test has found.
def _u(*protected: str) -> Universe:
    return Universe(n1=4, r2=3, c2=4, rs=4, cs=4, rsplit=2, csplit=2, protected=protected)


HAND_MADE = [
    # sibling row chunk: not reported
    Program(_u("Sr1"), (Step((("Sr0", ()),), "mul_"),)),
    # column chunk sibling, interleaved with Sc1 in memory: not reported
    Program(_u("Sc1"), (Step((("Sc0", ()),), "zero_"),)),
    # interleaved strided halves: the odd half is protected, the even one is written
    Program(_u("So"), (Step((("Se", ()),), "fill_"),)),
    # numpy alias of a protected tensor: reported
    Program(_u("P1"), (Step((("P1", (("np",),)),), "mul_"),)),
    # k = d['Sr1'][0]; k[-1] += 1 is reported once; the same on the sibling chunk is not
    Program(_u("Sr1"), (Step((("Sr1", (("select", 0, 0),)),), "aug", -1), Step((("Sr0", ()),), "aug", -1))),
    # a parent write hits both protected chunks; an out-of-place op hits nothing
    Program(_u("Sr1", "Sc1", "P1"), (Step((("S", ()),), "add_"), Step((("P1", ()),), "oop_mul"))),
    # Sn is another storage object over S's last row: a write through S hits it
    Program(_u("Sn"), (Step((("S", (("select", 0, -1),)),), "zero_"),)),
    # writing C's real parts leaves its imaginary parts alone
    Program(_u("Ci"), (Step((("C", (("real",),)),), "mul_"), Step((("C", (("imag",),)),), "mul_"))),
    # an empty entry has no element, so no write can touch it
    Program(_u("E"), (Step((("E", ()),), "mul_"),)),
    # copying a complex tensor's conjugate onto itself changes it: not a droppable self-copy
    Program(_u("C"), (Step((("C", ()),), "copy_conj"),)),
]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs())
def test_reports_exactly_the_writes_to_protected_memory(prog: Program) -> None:
    prog = resolve(prog)
    problems = run_guarded(prog)
    assert not problems, "kvguard disagrees with the byte oracle\n" + render(prog) + "\n" + "\n".join(problems)


for _prog in HAND_MADE:
    test_reports_exactly_the_writes_to_protected_memory = example(prog=_prog)(
        test_reports_exactly_the_writes_to_protected_memory
    )


# ---------------------------------------------------------------------------------------
# The oracle on hand-made cases (no kvguard involved)


def _span(t: torch.Tensor) -> tuple[int, int]:
    b = byte_set(t)
    return min(b), max(b) + 1


def test_oracle_sibling_row_chunk_does_not_overlap() -> None:
    big = torch.zeros(4, 3)
    rows = torch.split(big, 2, dim=0)
    assert not byte_set(rows[0]) & byte_set(rows[1])
    assert byte_set(rows[1]) <= byte_set(big)


def test_oracle_column_chunk_sibling_does_not_overlap_despite_interleaving() -> None:
    big = torch.zeros(3, 4)
    cols = torch.split(big, 2, dim=1)
    (a0, b0), (a1, b1) = _span(cols[0]), _span(cols[1])
    assert a0 < b1 and a1 < b0  # the byte intervals do overlap...
    assert not byte_set(cols[0]) & byte_set(cols[1])  # ...the elements do not
    assert byte_set(cols[0]) | byte_set(cols[1]) == byte_set(big)
    assert not byte_set(big[:, ::2]) & byte_set(big[:, 1::2])


def test_oracle_numpy_alias_overlaps() -> None:
    k = torch.arange(5.0)
    alias = torch.from_numpy(k.numpy())
    assert alias.untyped_storage()._cdata != k.untyped_storage()._cdata
    assert byte_set(alias) == byte_set(k)
    assert byte_set(k[2:].view(torch.uint8)[4:8]) == byte_set(k[3])


def test_oracle_aug_assign_on_last_element_overlaps() -> None:
    big = torch.zeros(4, 3)
    rows = torch.split(big, 2, dim=0)
    k = rows[1][0]
    protected = {"d['k']": byte_set(k)}
    assert hit_paths(written_bytes("aug", [k], -1), protected) == {"d['k']"}
    assert select_byte_set(k, -1) == byte_set(k[-1]) and len(select_byte_set(k, -1)) == 4
    assert hit_paths(written_bytes("aug", [rows[0]], -1), protected) == set()
    assert hit_paths(written_bytes("oop_mul", [k], 0), protected) == set()


def test_oracle_empty_and_dtype_views() -> None:
    k = torch.arange(6.0)
    assert byte_set(k[3:3]) == frozenset()
    assert byte_set(k.view(torch.int32)) == byte_set(k)
    assert len(byte_set(k.view(torch.uint8)[1::4])) == 6


def test_resolve_drops_only_invalid_parts() -> None:
    u = Universe(3, 2, 2, 2, 2, 1, 1, ("P1",))
    prog = Program(u, (
        Step((("P1", (("T",), ("select", 1, 0))),), "mul_"),  # select(1) on 1-D is invalid
        Step((("P1", (("select", 0, 0),)),), "aug", 0),  # t[0] on a 0-d tensor is invalid
    ))
    r = resolve(prog)
    assert r.steps == (Step((("P1", (("T",),)),), "mul_"),)


def test_oracle_complex_halves_and_conj_copy() -> None:
    c = torch.complex(torch.ones(2, 3), torch.ones(2, 3))
    imag = torch.view_as_real(c)[..., 1]
    assert byte_set(c.imag) == byte_set(imag) and not byte_set(c.real) & byte_set(imag)
    assert byte_set(c.real) | byte_set(imag) == byte_set(c)
    assert written_bytes("copy_conj", [c], 0) == byte_set(c)
    assert written_bytes("copy_conj", [c.real], 0) == frozenset()  # a real self-copy
