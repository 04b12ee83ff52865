"""Find every op that writes an argument its schema does not mark as written.

kvguard learns what an op writes from its schema (`alias_info.is_write`). A few ops write
an argument anyway: `aten::native_batch_norm` updates `running_mean` and `running_var` in
training, and says nothing. kvguard keeps those in `_UNDECLARED_WRITES` in
`kvguard/_torch/ops.py`; this sweep finds them and checks the table.

How it works
    Every OpInfo of `torch.testing._internal.common_methods_invocations.op_db` (its
    function, in-place and `out=` variants, each on fresh samples), every ModuleInfo of
    `common_modules.module_db` (forward in training and, where it differs, eval mode) and a
    few hand-written cases op_db does not reach (batch-norm entry points and overloads,
    fused optimizers, GradScaler, fake-quant observers, SobolEngine) run on CPU, float32
    (else the first dtype the op supports), under a `TorchDispatchMode`. For every op
    overload the mode sees, it clones every tensor argument (tensors inside lists too)
    before the call and compares after: the bytes of the values (NaN-aware: compared as
    uint8, so an untouched NaN is no change; quantized through `int_repr`, sparse through
    indices and values) and the metadata (shape, strides, offset, data pointer). An argument
    that changed although the schema does not mark it written is a candidate. Each new
    (overload, argument) candidate is replayed at once on fresh, independent clones of the
    pre-call arguments, outside any mode: a candidate is a finding only if the write
    happens again there. What does not reproduce is ruled out: a view of a declared-written
    argument (`x.add_(x)`, `torch.mul(y, 2, out=y)`), a view of another changed argument,
    or non-determinism.
    Generator state is not a tensor argument, so random ops do not show up; `out=`
    arguments are declared (`Tensor(a!)`) and never candidates.

    A finding is covered when kvguard itself, asked about that very call
    (`op_facts` + `written_tensors` on its arguments), counts the changed tensor as
    written. The exit status is 1 when a finding is not covered, 0 otherwise. For the bool
    arguments of each finding it prints which values the writes were seen with ("only
    when training=True"), which is the condition the table has to carry.

Usage
    python tools/sweep_undeclared_writes.py                       # everything (~1 minute)
    python tools/sweep_undeclared_writes.py --ops 'nn.BatchNorm*,native_batch_norm,extra:*'
    python tools/sweep_undeclared_writes.py --limit 20 --stride 10 --sources op_db
    python tools/sweep_undeclared_writes.py --backward            # also run backward passes

    `--ops` takes comma-separated fnmatch patterns over case names (op_db: `name` or
    `name.variant`; module_db: `nn.BatchNorm1d`; hand-written: `extra:...`). `--stride K`
    keeps every K-th case of each source, `--limit N` the first N of each.

Result of the full sweep (torch 2.13.0 CPU, 2 cores shared with other jobs)
    $ nice -n 10 timeout 3600 python tools/sweep_undeclared_writes.py --backward
    853 cases, 43129 calls (275 rejected by the op), 1046 op overloads seen, 119s

    writes the schema does not declare: 9
      aten::batch_norm_update_stats      running_mean values   1 calls  in table
      aten::batch_norm_update_stats      running_var  values   1 calls  in table
      aten::batch_norm_update_stats.out  running_mean values   1 calls  in table
      aten::batch_norm_update_stats.out  running_var  values   1 calls  in table
      aten::mkldnn_rnn_layer_backward    workspace    values  48 calls  in table  (nn.LSTM backward)
      aten::native_batch_norm            running_mean values  53 calls  in table  [only when training=True]
      aten::native_batch_norm            running_var  values  53 calls  in table  [only when training=True]
      aten::native_batch_norm.out        running_mean values   5 calls  in table  [only when training=True]
      aten::native_batch_norm.out        running_var  values   5 calls  in table  [only when training=True]

    ruled out: 2
      aten::addmm.out self: a view of an argument the schema marks written (236 calls)
      aten::mul.out self: a view of an argument the schema marks written (312 calls)
    (both in nn.functional.linear_cross_entropy's chunked backward, which accumulates
    into `out` with `self=out`)

    OK: every undeclared write is in the table        (exit 0; 128 s wall, 51 s CPU)

    Without --backward: 29008 calls, 22 s, the same rows less mkldnn_rnn_layer_backward.
    With --dtype float64 / complex64 (else the op's first dtype): the same rows less
    mkldnn_rnn_layer_backward (oneDNN's LSTM path is float32 only).

    Not reachable on CPU, in the table from their kernels' source: cudnn_batch_norm,
    miopen_batch_norm, batch_norm_gather_stats(_with_counts) (all with `.out`), the
    backend copies `_copy_from(_and_resize)` into `dst`, and
    `mkldnn_rnn_layer_backward.out` (checked by hand: it writes `workspace` like the
    functional overload). Left out: `_cudnn_rnn`/`miopen_rnn`'s `dropout_state`, which is
    RNG state, not data anyone protects.

Notes
    `_native_batch_norm_legit.no_stats` with training=False crashes torch 2.13 (SIGSEGV),
    so the hand-written case runs it in training only. Autograd's ZeroTensors have no
    memory and are skipped. `expecttest`, which torch.testing._internal imports, is
    stubbed when it is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import sys
import time
import traceback
import types
import unittest
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvguard._torch import ops as kv_torch

SOURCES = ("op_db", "module_db", "extra")
VARIANTS = ("function", "inplace", "out")


# ---------------------------------------------------------------------------------------
# What one call changed


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _bound(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[int, Any, Any]]:
    """(position, schema argument, value) for every argument the call passed."""
    for i, a in enumerate(schema.arguments):
        if not a.kwarg_only and i < len(args):
            yield i, a, args[i]
        elif a.name in kwargs:
            yield i, a, kwargs[a.name]


def _declared_write(a: Any) -> bool:
    return a.alias_info is not None and a.alias_info.is_write


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    if t.layout != torch.strided:
        return (t.dtype, t.layout, tuple(t.shape))
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.data_ptr())


def _raw(t: torch.Tensor) -> list[torch.Tensor]:
    """Flat uint8 views of what `t` holds (a copy where a view is impossible)."""
    t = t.detach()
    if t.layout == torch.sparse_coo:
        return _raw(t._indices()) + _raw(t._values())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return _raw(t.crow_indices()) + _raw(t.col_indices()) + _raw(t.values())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return _raw(t.ccol_indices()) + _raw(t.row_indices()) + _raw(t.values())
    if t.layout != torch.strided or t.is_nested or t.device.type == "meta" or t._is_zerotensor():
        return []  # ZeroTensors (autograd's zero gradients) have no memory to read
    if t.is_quantized:
        t = t.int_repr()
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.dtype.itemsize == 0 or t.numel() == 0:
        return []
    return [t.view(torch.uint8)]


def _clone(t: torch.Tensor) -> Optional[torch.Tensor]:
    if t._is_zerotensor():
        return None
    try:
        return t.detach().clone()
    except Exception:
        return None


def _changed(before: Optional[torch.Tensor], before_meta: tuple[Any, ...], t: torch.Tensor) -> Optional[str]:
    """"values", "metadata" or None."""
    if _meta(t) != before_meta:
        return "metadata"
    if before is None:
        return None
    try:
        a, b = _raw(before), _raw(t)
    except Exception:
        return None
    if len(a) != len(b) or any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(a, b)):
        return "values"
    return None


def _byte_range(t: torch.Tensor) -> Optional[tuple[int, int, int]]:
    if t.layout != torch.strided or t.is_nested or t.device.type == "meta" or t.numel() == 0 \
            or t._is_zerotensor():
        return None
    try:
        base = t.untyped_storage().data_ptr()
    except Exception:
        return None
    size = t.element_size()
    start = t.storage_offset() * size
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return base, start, start + extent * size


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    ra, rb = _byte_range(a), _byte_range(b)
    return ra is not None and rb is not None and ra[0] == rb[0] and ra[1] < rb[2] and rb[1] < ra[2]


def op_key(func: Any) -> str:
    """The schema's full name, overload included: `aten::native_batch_norm.out`."""
    schema = func._schema
    return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")


@dataclass
class Finding:
    op: str
    arg: str
    kind: str  # "values" or "metadata"
    first_case: str
    calls: int = 0
    covered_calls: int = 0
    bools: dict[str, set[bool]] = field(default_factory=dict)  # bool args' values on writing calls
    quiet_bools: dict[str, set[bool]] = field(default_factory=dict)  # ... on calls that did not write


@dataclass
class RuledOut:
    op: str
    arg: str
    reason: str
    first_case: str
    calls: int = 0


@dataclass
class SweepResult:
    findings: dict[tuple[str, str, str], Finding] = field(default_factory=dict)
    ruled_out: dict[tuple[str, str, str], RuledOut] = field(default_factory=dict)
    cases: int = 0
    calls: int = 0  # runs of an op, a variant or a module forward
    failed_calls: int = 0  # samples the op itself rejected (not a sweep failure)
    ops_seen: set[str] = field(default_factory=set)
    seconds: float = 0.0

    @property
    def missing(self) -> list[Finding]:
        """Findings kvguard does not count as written on at least one call."""
        return [f for f in self.findings.values() if f.covered_calls < f.calls]

    def stale(self) -> list[str]:
        """Table entries this sweep never saw writing (CUDA-only ops, or not in the subset)."""
        seen = {f.op for f in self.findings.values()}
        return sorted(k for k in kv_torch._UNDECLARED_WRITES if k not in seen)


class _Probe(TorchDispatchMode):
    """Compares every tensor argument of every op before and after the call."""

    def __init__(self, result: SweepResult) -> None:
        super().__init__()
        self.result = result
        self.case = ""
        self.changed_any: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        key = op_key(func)
        self.result.ops_seen.add(key)
        leaves: list[tuple[int, Any, torch.Tensor, Optional[torch.Tensor], tuple[Any, ...]]] = []
        for i, a, value in _bound(schema, args, kwargs):
            for t in _tensors(value):
                leaves.append((i, a, t, _clone(t), _meta(t)))
        out = func(*args, **kwargs)
        if not leaves:
            return out
        written = [t for _, a, t, _, _ in leaves if _declared_write(a)]
        changed = []
        for i, a, t, before, meta in leaves:
            if _declared_write(a):
                continue
            kind = _changed(before, meta, t)
            if kind is not None:
                changed.append((a, t, kind))
        bools = {a.name: bool(v) for _, a, v in _bound(schema, args, kwargs)
                 if str(a.type) == "bool" and isinstance(v, bool)}
        changed_names = {a.name for a, _, _ in changed}
        # Calls that did not write an argument a finding is known for: their bool values.
        for f in self.result.findings.values():
            if f.op == key and f.arg not in changed_names:
                for name, v in bools.items():
                    f.quiet_bools.setdefault(name, set()).add(v)
        if not changed:
            return out
        facts = kv_torch.op_facts(func)
        counted = kv_torch.written_tensors(facts, args, kwargs) if facts.written else []
        for a, t, kind in changed:
            k = (key, a.name, kind)
            if k in self.result.ruled_out:
                self.result.ruled_out[k].calls += 1
                continue
            finding = self.result.findings.get(k)
            if finding is None:
                reason = self._replay(func, schema, args, kwargs, leaves, a.name, kind, t, written, changed)
                if reason is not None:
                    self.result.ruled_out[k] = RuledOut(key, a.name, reason, self.case, 1)
                    continue
                finding = self.result.findings[k] = Finding(key, a.name, kind, self.case)
            finding.calls += 1
            finding.covered_calls += any(w is t for w in counted)
            for name, v in bools.items():
                finding.bools.setdefault(name, set()).add(v)
        return out

    def _replay(self, func: Any, schema: Any, args: Any, kwargs: Any, leaves: list[Any], name: str,
                kind: str, t: torch.Tensor, written: list[torch.Tensor], changed: list[Any]) -> Optional[str]:
        """None when the write happens again on independent clones; else why it is ruled out."""
        fresh = iter([before.clone() if before is not None else orig for _, _, orig, before, _ in leaves])
        target: list[tuple[Optional[torch.Tensor], tuple[Any, ...], torch.Tensor]] = []

        def rebuild(value: Any, is_target: bool) -> Any:
            if isinstance(value, torch.Tensor):
                new = next(fresh)
                if is_target:
                    target.append((_clone(new), _meta(new), new))
                return new
            if isinstance(value, (list, tuple)):
                items = [rebuild(v, is_target) for v in value]
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
            return value

        new_args = list(args)
        new_kwargs = dict(kwargs)
        for i, a, value in _bound(schema, args, kwargs):
            rebuilt = rebuild(value, a.name == name)
            if not a.kwarg_only and i < len(args):
                new_args[i] = rebuilt
            else:
                new_kwargs[a.name] = rebuilt
        try:
            torch.manual_seed(0)
            func(*new_args, **new_kwargs)
        except Exception as e:  # the op needs the aliasing the clones broke
            return f"replay on independent clones failed ({type(e).__name__})"
        if any(_changed(before, meta, new) is not None for before, meta, new in target):
            return None
        if any(_overlap(t, w) for w in written):
            return "a view of an argument the schema marks written"
        if any(other is not t and _overlap(t, other) for _, other, _ in changed):
            return "a view of another argument that changed"
        return "not reproduced on independent clones (non-deterministic?)"


# ---------------------------------------------------------------------------------------
# Cases


@dataclass
class Case:
    name: str
    source: str
    run: Callable[[_Probe, SweepResult, "Options"], None]


@dataclass
class Options:
    variants: tuple[str, ...] = VARIANTS
    backward: bool = False
    dtype: torch.dtype = torch.float32


def _import_testing() -> tuple[list[Any], list[Any]]:
    try:
        import expecttest  # noqa: F401  (torch.testing._internal.common_utils imports it)
    except ImportError:  # only its TestCase base class is used there
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stub
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
        from torch.testing._internal.common_modules import module_db
    return op_db, module_db


def _pick_dtype(supported: Iterable[torch.dtype], wanted: torch.dtype) -> Optional[torch.dtype]:
    supported = set(supported)
    if wanted in supported:
        return wanted
    order = (torch.float64, torch.int64, torch.bool, torch.complex64, torch.int32, torch.uint8,
             torch.float16, torch.bfloat16)
    return next((d for d in order if d in supported), next(iter(sorted(supported, key=str)), None))


def _call(probe: _Probe, result: SweepResult, label: str, fn: Callable[[], Any],
          backward: bool = False) -> None:
    result.calls += 1
    probe.case = label
    try:
        torch.manual_seed(0)
        with probe:
            out = fn()
            if backward:
                outs = [o for o in _tensors(out) if o.requires_grad and o.grad_fn is not None
                        and (o.is_floating_point() or o.is_complex())]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    except Exception:
        result.failed_calls += 1


def _opinfo_case(op: Any) -> Case:
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")

    def run(probe: _Probe, result: SweepResult, opts: Options) -> None:
        dtype = _pick_dtype(op.supported_dtypes("cpu"), opts.dtype)
        if dtype is None:
            return

        def samples(requires_grad: bool = False) -> list[Any]:
            torch.manual_seed(0)
            try:
                return list(op.sample_inputs("cpu", dtype, requires_grad=requires_grad))
            except Exception:
                result.failed_calls += 1
                return []

        def invoke(fn: Callable[..., Any], s: Any, **extra: Any) -> Callable[[], Any]:
            return lambda: fn(s.input, *s.args, **s.kwargs, **extra)

        if "function" in opts.variants:
            for n, s in enumerate(samples()):
                _call(probe, result, f"{name} [function] sample {n}", invoke(op.op, s))
        if "inplace" in opts.variants and op.inplace_variant is not None:
            for n, s in enumerate(samples()):
                _call(probe, result, f"{name} [inplace] sample {n}", invoke(op.inplace_variant, s))
        if "out" in opts.variants and op.supports_out:
            for n, s in enumerate(samples()):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        expected = op.op(s.input, *s.args, **s.kwargs)
                    if isinstance(expected, torch.Tensor):
                        out: Any = torch.empty_like(expected)
                    elif isinstance(expected, (tuple, list)) and all(isinstance(e, torch.Tensor) for e in expected):
                        out = tuple(torch.empty_like(e) for e in expected)
                    else:
                        continue
                except Exception:
                    continue
                _call(probe, result, f"{name} [out] sample {n}", invoke(op.op, s, out=out))
        if opts.backward and op.supports_autograd and (dtype.is_floating_point or dtype.is_complex):
            for n, s in enumerate(samples(requires_grad=True)):
                _call(probe, result, f"{name} [backward] sample {n}", invoke(op.op, s), backward=True)

    return Case(name, "op_db", run)


def _module_case(info: Any) -> Case:
    def run(probe: _Probe, result: SweepResult, opts: Options) -> None:
        dtype = _pick_dtype(info.dtypes, opts.dtype)
        if dtype is None:
            return
        for training in (True, False) if info.train_and_eval_differ else (True,):
            grad = opts.backward and (dtype.is_floating_point or dtype.is_complex)
            torch.manual_seed(0)
            try:
                inputs = list(info.module_inputs_func(info, device="cpu", dtype=dtype,
                                                      requires_grad=grad, training=training))
            except Exception:
                result.failed_calls += 1
                continue
            for n, mi in enumerate(inputs):
                if mi.forward_input is None:
                    continue
                try:
                    torch.manual_seed(0)
                    c = mi.constructor_input
                    module = info.module_cls(*c.args, **c.kwargs).to("cpu").to(dtype)
                    module.train(training)
                except Exception:
                    result.failed_calls += 1
                    continue
                f = mi.forward_input
                mode = "train" if training else "eval"
                _call(probe, result, f"{info.name} [{mode}] input {n}",
                      lambda: module(*f.args, **f.kwargs), backward=grad and training)

    return Case(info.name, "module_db", run)


# Hand-written cases for entry points and overloads that op_db and module_db do not call.
# Each builds its inputs outside the probe and returns what to run under it.
def _bn_args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(8, 3, 5), torch.rand(3) + 0.5, torch.randn(3), torch.randn(3), torch.rand(3) + 0.5


def _extra_cases() -> dict[str, Callable[[], Callable[[], Any]]]:
    aten = torch.ops.aten
    cases: dict[str, Callable[[], Callable[[], Any]]] = {}

    def add(name: str) -> Callable[[Callable[[], Callable[[], Any]]], Callable[[], Callable[[], Any]]]:
        def deco(fn: Callable[[], Callable[[], Any]]) -> Callable[[], Callable[[], Any]]:
            cases[f"extra:{name}"] = fn
            return fn
        return deco

    for training in (True, False):
        t = "train" if training else "eval"

        @add(f"torch.batch_norm.{t}")
        def _(training: bool = training) -> Callable[[], Any]:
            x, w, b, rm, rv = _bn_args()
            return lambda: torch.batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5, False)

        @add(f"torch.instance_norm.{t}")
        def _(training: bool = training) -> Callable[[], Any]:
            x, w, b, rm, rv = _bn_args()
            return lambda: torch.instance_norm(x, w, b, rm, rv, training, 0.1, 1e-5, False)

        @add(f"aten._batch_norm_impl_index.{t}")
        def _(training: bool = training) -> Callable[[], Any]:
            x, w, b, rm, rv = _bn_args()
            return lambda: aten._batch_norm_impl_index(x, w, b, rm, rv, training, 0.1, 1e-5, False)

        @add(f"aten.native_batch_norm.out.{t}")
        def _(training: bool = training) -> Callable[[], Any]:
            x, w, b, rm, rv = _bn_args()
            outs = torch.empty_like(x), torch.empty(3), torch.empty(3)
            return lambda: aten.native_batch_norm.out(x, w, b, rm, rv, training, 0.1, 1e-5, out=outs[0],
                                                      save_mean=outs[1], save_invstd=outs[2])

        @add(f"aten._native_batch_norm_legit.out.{t}")
        def _(training: bool = training) -> Callable[[], Any]:
            x, w, b, rm, rv = _bn_args()
            outs = torch.empty_like(x), torch.empty(3), torch.empty(3)
            return lambda: aten._native_batch_norm_legit.out(x, w, b, rm, rv, training, 0.1, 1e-5, out=outs[0],
                                                             save_mean=outs[1], save_invstd=outs[2])

        @add(f"aten._native_batch_norm_legit_functional.{t}")
        def _(training: bool = training) -> Callable[[], Any]:
            x, w, b, rm, rv = _bn_args()
            return lambda: aten._native_batch_norm_legit_functional(x, w, b, rm, rv, training, 0.1, 1e-5)

    @add("aten._native_batch_norm_legit.no_stats")  # training=False crashes torch 2.13 (no stats to use)
    def _() -> Callable[[], Any]:
        x, w, b, _, _ = _bn_args()
        return lambda: aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)

    @add("aten._native_batch_norm_legit_no_training")
    def _() -> Callable[[], Any]:
        x, w, b, rm, rv = _bn_args()
        return lambda: aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)

    @add("aten._batch_norm_with_update")
    def _() -> Callable[[], Any]:
        x, w, b, rm, rv = _bn_args()
        return lambda: aten._batch_norm_with_update(x, w, b, rm, rv, 0.1, 1e-5)

    @add("aten._batch_norm_with_update.out")
    def _() -> Callable[[], Any]:
        x, w, b, rm, rv = _bn_args()
        outs = torch.empty_like(x), torch.empty(3), torch.empty(3), torch.empty(0, dtype=torch.uint8)
        return lambda: aten._batch_norm_with_update.out(x, w, b, rm, rv, 0.1, 1e-5, out=outs[0], save_mean=outs[1],
                                                        save_invstd=outs[2], reserve=outs[3])

    @add("aten._batch_norm_with_update_functional")
    def _() -> Callable[[], Any]:
        x, w, b, rm, rv = _bn_args()
        return lambda: aten._batch_norm_with_update_functional(x, w, b, rm, rv, 0.1, 1e-5)

    @add("aten._batch_norm_no_update")
    def _() -> Callable[[], Any]:
        x, w, b, rm, rv = _bn_args()
        return lambda: aten._batch_norm_no_update(x, w, b, rm, rv, 0.1, 1e-5)

    @add("aten.batch_norm_update_stats")
    def _() -> Callable[[], Any]:
        x, _, _, rm, rv = _bn_args()
        return lambda: torch.batch_norm_update_stats(x, rm, rv, 0.1)

    @add("aten.batch_norm_update_stats.out")
    def _() -> Callable[[], Any]:
        x, _, _, rm, rv = _bn_args()
        outs = torch.empty(3), torch.empty(3)
        return lambda: aten.batch_norm_update_stats.out(x, rm, rv, 0.1, out0=outs[0], out1=outs[1])

    @add("nn.SyncBatchNorm.eval")
    def _() -> Callable[[], Any]:
        m = torch.nn.SyncBatchNorm(3).eval()
        x = torch.randn(4, 3, 5)
        return lambda: m(x)

    def optimizer(cls: Any, **kw: Any) -> Callable[[], Callable[[], Any]]:
        def build() -> Callable[[], Any]:
            ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
            for p in ps:
                p.grad = torch.randn_like(p)
            opt = cls(ps, **kw)
            opt.step()  # state exists from here on
            return opt.step
        return build

    for impl in ("fused", "foreach"):
        flag = {impl: True}
        cases[f"extra:optim.Adam.{impl}"] = optimizer(torch.optim.Adam, lr=0.1, **flag)
        cases[f"extra:optim.Adam.amsgrad.{impl}"] = optimizer(torch.optim.Adam, lr=0.1, amsgrad=True, **flag)
        cases[f"extra:optim.AdamW.{impl}"] = optimizer(torch.optim.AdamW, lr=0.1, **flag)
        cases[f"extra:optim.SGD.momentum.{impl}"] = optimizer(torch.optim.SGD, lr=0.1, momentum=0.9, **flag)
        cases[f"extra:optim.Adagrad.{impl}"] = optimizer(torch.optim.Adagrad, lr=0.1, **flag)

    @add("amp.GradScaler.cpu")
    def _() -> Callable[[], Any]:
        p = torch.nn.Parameter(torch.randn(4))
        p.grad = torch.randn(4)
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
        scaler.scale(torch.ones(()))  # creates the scale tensor outside the probe

        def step() -> None:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        return step

    @add("ao.FusedMovingAvgObsFakeQuantize")
    def _() -> Callable[[], Any]:
        fq = torch.ao.quantization.FusedMovingAvgObsFakeQuantize()
        x = torch.randn(4, 3)
        fq(x)
        return lambda: fq(x)

    @add("quasirandom.SobolEngine.draw")
    def _() -> Callable[[], Any]:
        engine = torch.quasirandom.SobolEngine(3, scramble=True, seed=0)
        engine.draw(1)  # the first point takes another path
        return lambda: engine.draw(4)

    @add("nn.RReLU.train")
    def _() -> Callable[[], Any]:
        m = torch.nn.RReLU().train()
        x = torch.randn(6)
        return lambda: m(x)

    @add("nn.Embedding.max_norm")
    def _() -> Callable[[], Any]:
        m = torch.nn.Embedding(10, 3, max_norm=0.5)
        idx = torch.tensor([1, 2, 2, 7])
        return lambda: m(idx)

    @add("nn.utils.clip_grad_norm_")
    def _() -> Callable[[], Any]:
        ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
        for p in ps:
            p.grad = torch.randn(3) * 10
        return lambda: torch.nn.utils.clip_grad_norm_(ps, 1.0)

    return cases


def callable_case(name: str, build: Callable[[], Callable[[], Any]]) -> Case:
    """A case that runs `build()` outside the probe and what it returns under it."""
    def run(probe: _Probe, result: SweepResult, opts: Options) -> None:
        try:
            torch.manual_seed(0)
            fn = build()
        except Exception:
            result.failed_calls += 1
            return
        _call(probe, result, name, fn)

    return Case(name, "extra", run)


def select_cases(ops: Optional[Iterable[str]] = None, *, sources: Iterable[str] = SOURCES,
                 limit: Optional[int] = None, stride: Optional[int] = None) -> list[Case]:
    """The cases to run: by fnmatch patterns over their names, every `stride`-th, the first `limit`."""
    patterns = [p for p in (ops or ()) if p]
    sources = tuple(sources)
    op_db, module_db = _import_testing()
    every: dict[str, list[Case]] = {
        "op_db": [_opinfo_case(op) for op in op_db],
        "module_db": [_module_case(info) for info in module_db],
        "extra": [callable_case(n, b) for n, b in _extra_cases().items()],
    }
    chosen: list[Case] = []
    for source in SOURCES:
        if source not in sources:
            continue
        cases = [c for c in every[source] if not patterns or any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
        if stride:
            cases = cases[::stride]
        if limit is not None:
            cases = cases[:limit]
        chosen.extend(cases)
    return chosen


def run_sweep(cases: Iterable[Case], options: Optional[Options] = None,
              progress: Optional[Callable[[str], None]] = None, verbose: bool = False) -> SweepResult:
    opts = options or Options()
    result = SweepResult()
    probe = _Probe(result)
    start = time.perf_counter()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        for case in cases:
            result.cases += 1
            t0 = time.perf_counter()
            if progress and verbose:
                progress(f"[{result.cases}] {case.name}")
            try:
                case.run(probe, result, opts)
            except Exception:  # a case that breaks is reported, never hides the rest
                result.failed_calls += 1
                if progress:
                    progress(f"{case.name}: {traceback.format_exc(limit=1).strip()}")
            if progress and time.perf_counter() - t0 > 10:
                progress(f"{case.name}: {time.perf_counter() - t0:.0f}s")
    result.seconds = time.perf_counter() - start
    return result


# ---------------------------------------------------------------------------------------
# Report


def _condition(f: Finding) -> str:
    """Bool arguments whose value decides the write, as far as the sweep saw."""
    parts = []
    for name, seen in sorted(f.bools.items()):
        quiet = f.quiet_bools.get(name, set())
        if len(seen) == 1:
            (v,) = seen
            parts.append(f"only when {name}={v}" if (not v) in quiet else f"{name}={v} in every write")
    return "; ".join(parts)


def format_result(result: SweepResult) -> str:
    lines = [f"{result.cases} cases, {result.calls} calls ({result.failed_calls} rejected by the op), "
             f"{len(result.ops_seen)} op overloads seen, {result.seconds:.0f}s"]
    rows = sorted(result.findings.values(), key=lambda f: (f.op, f.arg))
    lines.append("")
    lines.append(f"writes the schema does not declare: {len(rows)}")
    w = max([len(f.op) for f in rows] + [2])
    for f in rows:
        state = "in table" if f.covered_calls == f.calls else \
            f"MISSING from table ({f.calls - f.covered_calls}/{f.calls} calls)"
        cond = _condition(f)
        lines.append(f"  {f.op:<{w}}  {f.arg:<12} {f.kind:<8} {f.calls:>4} calls  {state}"
                     + (f"  [{cond}]" if cond else "") + f"  first: {f.first_case}")
    ruled = sorted(result.ruled_out.values(), key=lambda r: (r.reason, r.op, r.arg))
    lines.append("")
    lines.append(f"ruled out: {len(ruled)}")
    for r in ruled:
        lines.append(f"  {r.op} {r.arg}: {r.reason} ({r.calls} calls; first: {r.first_case})")
    stale = result.stale()
    if stale:
        lines.append("")
        lines.append("table entries this run never saw writing (CUDA/ROCm-only, or outside the subset): "
                     + ", ".join(stale))
    missing = result.missing
    lines.append("")
    lines.append("FAIL: " + ", ".join(sorted({f"{f.op} {f.arg}" for f in missing})) + " missing from "
                 "kvguard._torch.ops._UNDECLARED_WRITES" if missing else "OK: every undeclared write is in the table")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--ops", default="", help="comma-separated fnmatch patterns over case names")
    parser.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, of {', '.join(SOURCES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"op_db variants, of {', '.join(VARIANTS)}")
    parser.add_argument("--limit", type=int, default=None, help="at most this many cases from each source")
    parser.add_argument("--stride", type=int, default=None, help="every K-th case of each source")
    parser.add_argument("--backward", action="store_true", help="also run backward (op_db and module_db)")
    parser.add_argument("--dtype", default="float32", help="preferred dtype (default float32)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--skip", default="", help="comma-separated fnmatch patterns of cases to leave out")
    parser.add_argument("--verbose", action="store_true", help="name each case on stderr as it starts")
    parser.add_argument("--list", action="store_true", help="print the selected case names and exit")
    ns = parser.parse_args(argv)
    torch.set_num_threads(ns.threads)
    cases = select_cases(ns.ops.split(","), sources=[s for s in ns.sources.split(",") if s],
                         limit=ns.limit, stride=ns.stride)
    skip = [p for p in ns.skip.split(",") if p]
    cases = [c for c in cases if not any(fnmatch.fnmatchcase(c.name, p) for p in skip)]
    if ns.list:
        print("\n".join(c.name for c in cases))
        return 0
    opts = Options(variants=tuple(v for v in ns.variants.split(",") if v), backward=ns.backward,
                   dtype=getattr(torch, ns.dtype))
    result = run_sweep(cases, opts, progress=lambda s: print(s, file=sys.stderr, flush=True), verbose=ns.verbose)
    print(format_result(result))
    return 1 if result.missing else 0


if __name__ == "__main__":
    sys.exit(main())
