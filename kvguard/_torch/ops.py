"""Op facts: which arguments an op call writes, read from its schema (`func._schema`).

Schemas miss some writes: c10d's in-place collectives mark no argument written, and a few
ops write arguments they do not declare (`_UNDECLARED_WRITES`); both tables live here, and
the compiled hook reads them too (`kvguard._torch.__getattr__`). Pure: reads schemas and
the arguments' types, never a tensor's values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Mapping, NamedTuple, Optional, Sequence

import torch

from kvguard._torch.tensors import PLAIN, STRIDED, same_geometry

if TYPE_CHECKING:
    from torch._C import FunctionSchema

# c10d's in-place collectives mark no argument as written (their schemas carry no alias
# annotation), so a schema-only filter drops them. These are the parameters they write.
_C10D_WRITTEN_NAMES = frozenset(
    {"tensors", "output_tensor", "output_tensors", "outputs", "output", "output_lists"}
)
# Ops that write arguments their schema does not mark as written (no `!` annotation), keyed
# by the schema's full name with its overload: which parameters they write, and the bool
# parameter that must be true for the write to happen (None: every call writes). The CPU
# rows are what `tools/sweep_undeclared_writes.py` finds over torch's OpInfo and ModuleInfo
# samples (tests/test_undeclared_writes.py pins it); the others are CUDA/ROCm/MPS kernels
# that the sweep cannot run on CPU, taken from their source.
_RUNNING_STATS = ("running_mean", "running_var")
_UNDECLARED_WRITES: dict[str, tuple[tuple[str, ...], Optional[str]]] = {
    # Found by the sweep on CPU.
    "aten::native_batch_norm": (_RUNNING_STATS, "training"),
    "aten::native_batch_norm.out": (_RUNNING_STATS, "training"),
    "aten::batch_norm_update_stats": (_RUNNING_STATS, None),
    "aten::batch_norm_update_stats.out": (_RUNNING_STATS, None),
    # LSTM/GRU backward on CPU (oneDNN) scribbles over the forward's workspace.
    "aten::mkldnn_rnn_layer_backward": (("workspace",), None),
    "aten::mkldnn_rnn_layer_backward.out": (("workspace",), None),
    # cuDNN and MIOpen batch norm (training updates the running statistics in place).
    "aten::cudnn_batch_norm": (_RUNNING_STATS, "training"),
    "aten::cudnn_batch_norm.out": (_RUNNING_STATS, "training"),
    "aten::miopen_batch_norm": (_RUNNING_STATS, "training"),
    "aten::miopen_batch_norm.out": (_RUNNING_STATS, "training"),
    # SyncBatchNorm's CUDA reduction across ranks updates them whenever they are given.
    "aten::batch_norm_gather_stats": (_RUNNING_STATS, None),
    "aten::batch_norm_gather_stats.out": (_RUNNING_STATS, None),
    "aten::batch_norm_gather_stats_with_counts": (_RUNNING_STATS, None),
    "aten::batch_norm_gather_stats_with_counts.out": (_RUNNING_STATS, None),
    # Backend copies (MPS, lazy, XLA) into `dst`; `copy_` reaches them below the mode,
    # so they are seen only when called directly.
    "aten::_copy_from": (("dst",), None),
    "aten::_copy_from.out": (("dst",), None),
    "aten::_copy_from_and_resize": (("dst",), None),
    "aten::_copy_from_and_resize.out": (("dst",), None),
}
# inplace_view ops that make a tensor refer to other memory, rather than only changing
# its shape or strides.
_REPOINTING_OPS = frozenset({"set_", "resize_", "resize_as_", "resize_as_sparse_"})


class WriteCondition(NamedTuple):
    """A bool parameter that must be true for an undeclared write to happen (`training`)."""

    position: int
    name: str
    kwarg_only: bool
    default: bool  # when the call leaves it out


class WrittenArg(NamedTuple):
    """A parameter an op writes: its position, its name, and whether it is keyword-only."""

    position: int
    name: str
    kwarg_only: bool
    when: Optional[WriteCondition] = None  # written only on calls where this is true


OpKind = Literal["write", "metadata", "repoint"]  # what a writing op does: values, metadata (inplace_view), memory


class OpFacts(NamedTuple):
    """What the guard needs to know about one op overload, computed once per overload."""

    written: tuple[WrittenArg, ...]
    kind: OpKind  # "write", "metadata" (inplace_view) or "repoint" (set_, resize_)
    self_only: bool = False  # writes exactly its first positional `Tensor` argument
    resizes: bool = False  # an `out=` op: it may resize (and so write) an empty argument
    uncounted: bool = False  # writes arguments its schema does not mark: no version counter sees those
    # Indexes into `written` of the arguments it writes but returns no alias of (`rrelu_with_noise_`'s
    # noise, `_amp_update_scale_`'s growth tracker): autograd bumps the version of what an op returns
    # only, so no version counter sees these writes either. Only where every written argument is
    # one plain `Tensor`, so the indexes are those of `written_tensors`.
    unreturned: tuple[int, ...] = ()


NO_WRITES = OpFacts((), "write")
# Keyed by id(): OpOverload hashes in Python, and this lookup runs for every op. The
# overload is kept in the value, so an id can never be reused while it is cached.
_facts_cache: dict[int, tuple[object, OpFacts]] = {}


def op_facts(func: object) -> OpFacts:
    """Which arguments `func` writes, from its schema (cached per overload)."""
    cached = _facts_cache.get(id(func))
    if cached is None:
        cached = _facts_cache[id(func)] = (func, _learn(func))
    return cached[1]


def _schema(func: object) -> Optional[FunctionSchema]:
    """The op's schema (an `OpOverload`'s `_schema`), or None for anything else."""
    schema: Optional[FunctionSchema] = getattr(func, "_schema", None)
    return schema


def _learn(func: object) -> OpFacts:
    schema = _schema(func)
    if schema is None:
        return NO_WRITES
    written = tuple(
        WrittenArg(i, a.name, a.kwarg_only)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    if not written and getattr(func, "namespace", "") == "c10d":
        if schema.name.endswith("_"):
            written = tuple(
                WrittenArg(i, a.name, a.kwarg_only)
                for i, a in enumerate(schema.arguments)
                if a.name in _C10D_WRITTEN_NAMES
            )
    undeclared = _UNDECLARED_WRITES.get(
        f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name)
    if undeclared is not None:
        written = _add_undeclared(schema, written, *undeclared)
    if not written:
        return NO_WRITES
    base_name = schema.name.split("::")[-1]
    kind: OpKind
    if base_name in _REPOINTING_OPS:
        kind = "repoint"
    elif torch.Tag.inplace_view in getattr(func, "tags", ()):
        kind = "metadata"
    else:
        kind = "write"
    self_only = (len(written) == 1 and written[0].position == 0 and not written[0].kwarg_only
                 and str(schema.arguments[0].type) == "Tensor")
    # An aten functional op that writes an argument (`rrelu_with_noise`'s noise, batch norm's
    # running statistics) bumps no version counter: autograd's check never sees that write either.
    resizes = any(a.kwarg_only for a in written)  # `out=` arguments are keyword-only
    functional = (getattr(func, "namespace", "") == "aten" and not base_name.endswith("_") and not resizes
                  and not _INPLACE_OR_OUT_TAGS & set(getattr(func, "tags", ())))
    return OpFacts(written, kind, self_only, resizes, undeclared is not None or (functional and kind == "write"),
                   _unreturned(schema, written) if undeclared is None and kind == "write" else ())


def _unreturned(schema: FunctionSchema, written: tuple[WrittenArg, ...]) -> tuple[int, ...]:
    """The indexes into `written` of the arguments no return aliases, in an op that returns some of
    the others (a mix: `rrelu_with_noise_`); () otherwise."""
    returned: set[str] = set()
    for ret in schema.returns:
        if ret.alias_info is not None:
            returned.update(ret.alias_info.before_set)
    infos = [schema.arguments[arg.position] for arg in written]
    aliases = [a.alias_info for a in infos]
    if any(arg.when is not None for arg in written) or any(str(a.type) != "Tensor" or a.alias_info is None
                                                           for a in infos):
        return ()
    unreturned = tuple(i for i, alias in enumerate(aliases)
                       if alias is not None and not returned & set(alias.before_set))
    return unreturned if len(unreturned) < len(written) else ()


# `Tag.inplace` is newer than torch 2.11; the name and keyword-only `out=` tell the rest.
_INPLACE_OR_OUT_TAGS = frozenset(t for t in (getattr(torch.Tag, "inplace", None), getattr(torch.Tag, "out", None))
                                 if t is not None)


def written_tensors(facts: OpFacts, args: Sequence[object], kwargs: Mapping[str, object]) -> list[torch.Tensor]:
    """The tensors an op call writes, with `Tensor[]` and `Tensor[][]` lists flattened."""
    if facts.self_only:  # `mul_`, `copy_`, `index_put_`...: the common case, kept cheap
        first = args[0] if args else kwargs.get("self")
        return [first] if isinstance(first, torch.Tensor) else []
    found: list[torch.Tensor] = []
    for arg in facts.written:
        if arg.when is not None and not _holds(arg.when, args, kwargs):
            continue
        if not arg.kwarg_only and arg.position < len(args):
            _collect(args[arg.position], found)
        else:
            _collect(kwargs.get(arg.name), found)
    return found


def shared_reads(facts: OpFacts, args: Sequence[object], kwargs: Mapping[str, object],
                 written: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The tensors an op call only reads (no argument it writes) that share a storage with a tensor it
    writes: what a self-overlapping write (`data[:, 1:].copy_(data[:, :-1])`) reads. Asked on a hit only."""
    storages = {_storage_key(w) for w in written} - {None}
    if not storages:
        return ()
    positions = {a.position for a in facts.written if not a.kwarg_only}
    names = {a.name for a in facts.written}
    found: list[torch.Tensor] = []
    for i, arg in enumerate(args):
        if i not in positions:
            _collect(arg, found)
    for name, arg in kwargs.items():
        if name not in names:
            _collect(arg, found)
    return tuple(t for t in found if _storage_key(t) in storages
                 and not any(t is w or same_geometry(t, w) for w in written))  # `add(x, 1, out=x)`: none


def _storage_key(t: torch.Tensor) -> Optional[tuple[torch.device, int]]:
    try:
        if type(t) not in PLAIN or t.layout != STRIDED or t.is_meta:
            return None
        address = int(t.untyped_storage().data_ptr())
        return (t.device, address) if address else None
    except Exception:  # noqa: BLE001 - a tensor with no storage reads nothing it writes
        return None


def _add_undeclared(schema: FunctionSchema, written: tuple[WrittenArg, ...], names: tuple[str, ...],
                    when: Optional[str]) -> tuple[WrittenArg, ...]:
    """`written` plus the parameters `names` (see `_UNDECLARED_WRITES`), in schema order."""
    condition = None
    for i, a in enumerate(schema.arguments):
        if a.name == when:
            default = a.default_value
            condition = WriteCondition(i, a.name, a.kwarg_only, True if default is None else bool(default))
    # A torch that renamed the condition leaves `condition` None: every call counts as writing.
    known = {w.name for w in written}
    extra = tuple(WrittenArg(i, a.name, a.kwarg_only, condition)
                  for i, a in enumerate(schema.arguments) if a.name in names and a.name not in known)
    return tuple(sorted(written + extra, key=lambda w: w.position))


def _holds(condition: WriteCondition, args: Sequence[object], kwargs: Mapping[str, object]) -> bool:
    if not condition.kwarg_only and condition.position < len(args):
        return bool(args[condition.position])
    return bool(kwargs.get(condition.name, condition.default))


def _collect(value: object, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found)


def short_op_name(func: object) -> str:
    """`aten.mul_.Tensor`, the name users see in reports."""
    return str(func)


def base_name(func: object) -> str:
    """The op's name without namespace or overload (`aten::add_.Tensor`: `add_`); "" without a schema."""
    schema = _schema(func)
    return schema.name.rpartition("::")[2] if schema is not None else ""


def tensor_params(func: object) -> list[tuple[int, str, bool]]:
    """(position, name, keyword-only) of each `Tensor` parameter of the op's schema."""
    schema = _schema(func)
    if schema is None:
        raise AttributeError(f"{func!r} has no schema")
    return [(i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments) if str(a.type) == "Tensor"]


def argument_count(func: object) -> int:
    """How many arguments the op's schema takes (`aten.relu_`: 1, `self` only); 0 when it has no schema."""
    schema = _schema(func)
    return len(schema.arguments) if schema is not None else 0
