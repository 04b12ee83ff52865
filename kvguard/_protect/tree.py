"""Walk guarded objects to the tensors inside, with paths you can paste.

What is walked (each kind is recognised by its type, once per type per walk):

- dicts, dict subclasses (`OrderedDict`, `defaultdict`, ...), lists, tuples and
  namedtuples, read from their own storage (no `__getitem__`, no default factory);
- dataclass instances (their fields, then any other instance attributes) and
  `types.SimpleNamespace`: attribute steps, `exp.kl`;
- objects registered as pytree nodes in `torch.utils._pytree` (TensorDict and its
  relatives, `deque`, your own `register_pytree_node` classes), through their
  flatten-with-keys function: `td['kl']`, `obj.field`, `lazy[0]`;
- every other `collections.abc.Mapping` (`UserDict`, ...), through `iter` and `[key]`.

Anything else (modules, argparse namespaces, numpy arrays, arbitrary objects) is a leaf.

Placement is noticed by comparing, by identity, what the watched containers hold: every
dict and list met, the instance `__dict__` of every attribute container, and the
dicts and lists that non-dict Mappings and pytree nodes keep in their `__dict__` (a
TensorDict's `_tensordict`, a `UserDict`'s `data`). Slots and deques, which the C check
cannot see into, are read in Python; only guards that hold one pay for it.

Stdlib only: a leaf is a tensor when `is_tensor(leaf)` says so, so this module never
imports torch; it asks the fence for pytree nodes (`kvguard._torch.pytree`) only when torch
is already imported.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import keyword
import sys
import types
from collections.abc import Mapping
from itertools import accumulate, chain, islice
from operator import is_
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, NamedTuple, Optional, Union, cast

if TYPE_CHECKING:
    import torch

    from kvguard._torch.pytree import Child as PytreeChild

Container = Any  # anything walked: dict, list, tuple, dataclass, namespace, pytree node, Mapping
Step = object  # a chain step: an item's key or index, an `Attr`, or a pytree node's own key
Chain = tuple[tuple[Container, Step], ...]  # (container, step) from the root down


class Attr(NamedTuple):
    """An attribute step of a chain: `exp.kl` is `(exp, Attr("kl"))`; an item step is the key itself."""

    name: str


class Leaf(NamedTuple):
    """A tensor found in the tree: its path, itself, and `(container, step)` from the root."""

    path: str
    tensor: torch.Tensor
    chain: Chain


_leaf = functools.partial(tuple.__new__, Leaf)  # Leaf((path, tensor, chain)) without the Python-level __new__


class Run(NamedTuple):
    """The leaves of a list of tensors in one piece (a walk with `runs`): `tensors[i]` is at
    `f"{path}[{i}]"`, by the chain `chain + ((lst, i),)`. No leaf is made per tensor."""

    path: str
    lst: list[object]  # the list itself (it holds `tensors`)
    chain: Chain
    tensors: list[torch.Tensor]

    def leaves(self) -> list[Leaf]:
        return [_leaf((f"{self.path}[{i}]", t, self.chain + ((self.lst, i),))) for i, t in enumerate(self.tensors)]


def leaves_of(found: list[Union[Leaf, Run]]) -> list[Leaf]:
    """A walk's leaves with its runs spelled out, one leaf per tensor."""
    if not any(type(item) is Run for item in found):
        return cast(list[Leaf], found)
    out: list[Leaf] = []
    for item in found:
        if isinstance(item, Run):
            out += item.leaves()
        else:
            out.append(item)
    return out


class Probe(NamedTuple):
    """A container the C check cannot see into (slots, a deque): `read(obj)` gives what it holds."""

    obj: object
    read: Callable[[Any], tuple[object, ...]]  # `tuple` for a deque


# kinds of container
_LEAF, _DICT, _LIST, _TUPLE, _NAMEDTUPLE, _DATACLASS, _NAMESPACE, _PYTREE, _MAPPING = range(9)
_ATTRIBUTE_KINDS = (_DATACLASS, _NAMESPACE, _PYTREE, _MAPPING)


# The fence's pytree reads (`kvguard._torch.pytree`), found once torch is imported: every walk asks them.
_registered_nodes: Optional[Callable[[], Optional[Mapping[type, object]]]] = None
_node_children: Optional[Callable[[object], Iterator[PytreeChild]]] = None


def _load_pytree() -> None:
    """Find the fence's pytree reads, only if torch is imported already (never imports torch)."""
    global _registered_nodes, _node_children
    if _registered_nodes is None and "torch" in sys.modules:
        from kvguard._torch import pytree  # torch is imported: this adds the fence's pytree reads

        _registered_nodes, _node_children = pytree.registered_nodes, pytree.children


def _pytree_nodes() -> Optional[Mapping[type, object]]:
    _load_pytree()
    return _registered_nodes() if _registered_nodes is not None else None


def _kind(tp: type, nodes: Optional[Mapping[type, object]]) -> int:
    try:
        if issubclass(tp, dict):
            return _DICT
        if issubclass(tp, list):
            return _LIST
        if issubclass(tp, tuple):
            return _NAMEDTUPLE if isinstance(getattr(tp, "_fields", None), tuple) else _TUPLE
        if nodes is not None and tp in nodes:
            return _PYTREE
        if dataclasses.is_dataclass(tp):
            return _DATACLASS
        if issubclass(tp, types.SimpleNamespace):
            return _NAMESPACE
        if issubclass(tp, Mapping):
            return _MAPPING
    except Exception:  # noqa: BLE001 - a metaclass whose checks raise: not walked
        pass
    return _LEAF


_COMMON_LEAVES = (int, float, str, bool, bytes, type(None))
_COMMON_KINDS: dict[type, int] = {dict: _DICT, list: _LIST, tuple: _TUPLE, **{tp: _LEAF for tp in _COMMON_LEAVES}}


def walkable(obj: object) -> bool:
    """Whether `walk` looks inside `obj` (a tensor is a leaf, not walkable)."""
    return _kind(type(obj), _pytree_nodes()) != _LEAF


def is_container(obj: object) -> bool:
    return walkable(obj)


def _repr(key: object) -> str:
    try:
        return repr(key)
    except Exception:  # noqa: BLE001 - a key whose repr raises
        return f"<{type(key).__name__}>"


def _attr(name: object) -> str:
    if isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name):
        return f".{name}"
    return f".__dict__[{_repr(name)}]"  # setattr(ns, "a-b", t)


def _instance_dict(obj: object) -> Optional[dict[str, Any]]:
    try:
        found = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - no __dict__ (slots), or a property that raises
        return None
    return found if isinstance(found, dict) else None


# One child: (key for `keys`/`ignore`, the child, chain step, path suffix if not the step's own)
_Child = tuple[object, object, Step, Optional[str]]


def step_text(step: object) -> str:
    """The path suffix of a chain step: `.kl` for `Attr("kl")`, `['kl']` / `[0]` for an item."""
    if type(step) is int:  # a list index, the most common step: no repr call
        return f"[{step}]"
    return _attr(step.name) if type(step) is Attr else f"[{_repr(step)}]"


def _children(obj: Any, kind: int) -> list[_Child]:
    """The children of one container of `kind`, in order; user code that raises stops the list there."""
    if kind == _DICT:
        return [(key, value, key, None) for key, value in dict.items(obj)]
    if kind == _LIST:
        return [(i, value, i, None) for i, value in enumerate(list.copy(obj))]
    if kind == _TUPLE:
        return [(i, value, i, None) for i, value in enumerate(tuple(obj))]
    if kind == _NAMEDTUPLE:
        return [(field, value, Attr(field), None) for field, value in zip(type(obj)._fields, tuple(obj))]
    if kind == _NAMESPACE:
        return [(name, value, Attr(name), None) for name, value in list((_instance_dict(obj) or {}).items())]
    found: list[_Child] = []
    try:
        more = (_dataclass_children(obj) if kind == _DATACLASS else _pytree_children(obj) if kind == _PYTREE
                else _mapping_children(obj) if kind == _MAPPING else iter(()))
        for child in more:
            found.append(child)
    except Exception:  # noqa: BLE001 - a flatten or an iteration that raises: what came before
        pass
    return found


def _dataclass_children(obj: Any) -> Iterator[_Child]:
    """Fields in order (from the instance dict, else through slots), then other attributes."""
    own = _instance_dict(obj) or {}
    names = [f.name for f in dataclasses.fields(obj)]
    for name in names:
        if name in own:
            value = own[name]
        else:
            try:
                value = getattr(obj, name)
            except Exception:  # noqa: BLE001 - an unset slot, a property that raises
                continue
        yield name, value, Attr(name), None
    fields = set(names)
    for name, value in list(own.items()):
        if name not in fields:
            yield name, value, Attr(name), None


def _pytree_children(obj: object) -> Iterator[_Child]:
    _load_pytree()
    if _node_children is None:
        return
    for how, key, value in _node_children(obj):
        if how == "item":  # a mapping key or a sequence index
            yield key, value, key, None
        elif how == "attr":
            yield key, value, Attr(cast(str, key)), None
        else:  # a key class of the node's own: it prints as its path suffix
            try:
                suffix = str(key)
            except Exception:  # noqa: BLE001
                suffix = f"[{_repr(key)}]"
            yield key, value, key, suffix


def _mapping_children(obj: Mapping[object, object]) -> Iterator[_Child]:
    """Any other Mapping: its keys (at most `len()` of them), each read once with `[key]`."""
    for key in list(islice(iter(obj), len(obj))):
        try:
            value = obj[key]
        except Exception:  # noqa: BLE001 - a key whose lookup raises: skipped
            continue
        yield key, value, key, None


def child_items(obj: Container) -> Iterator[tuple[object, str, object]]:
    """`(key, path suffix, child)` of one container: `['kl']`, `[0]`, `.field`."""
    try:
        children = _children(obj, _kind(type(obj), _pytree_nodes()))
    except Exception:  # noqa: BLE001
        return
    for key, value, step, suffix in children:
        yield key, suffix if suffix is not None else step_text(step), value


def _slot_descriptors(tp: type) -> tuple[types.MemberDescriptorType, ...]:
    """The member descriptors of every slot of `tp` (its own and its bases')."""
    found = []
    for klass in tp.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            desc = klass.__dict__.get(name)
            if isinstance(desc, types.MemberDescriptorType):
                found.append(desc)
    return tuple(found)


_UNSET = object()  # an empty slot
_Slots = dict[type, tuple[types.MemberDescriptorType, ...]]  # each type's slot descriptors, per walk


def _read_slots(descriptors: tuple[types.MemberDescriptorType, ...]) -> Callable[[object], tuple[object, ...]]:
    def read(obj: object) -> tuple[object, ...]:
        values = []
        for desc in descriptors:
            try:
                values.append(desc.__get__(obj, type(obj)))
            except AttributeError:
                values.append(_UNSET)
        return tuple(values)
    return read


class Owner(NamedTuple):
    """The walked container a watched dict, list or probe belongs to, and where it is in the tree."""

    obj: Container
    path: str
    chain: Chain


_owner = functools.partial(tuple.__new__, Owner)  # Owner((obj, path, chain)) without the Python-level __new__


def _watch(obj: object, kind: int, watched: list[Container], ids: set[int], slots: _Slots,
           owner: Optional[Owner], owners: Optional[dict[int, Owner]]) -> None:
    """Add what must be compared to notice a store into `obj` (and, in `owners`, that it is `obj`'s)."""

    def add(container: object) -> None:
        if id(container) not in ids:
            ids.add(id(container))
            watched.append(container)
            if owners is not None:
                owners[id(container)] = owner  # type: ignore[assignment]

    if kind in (_DICT, _LIST):
        add(obj)
        return
    if kind not in _ATTRIBUTE_KINDS:
        return  # tuples and namedtuples are immutable
    attributes: list[object] = []
    own = _instance_dict(obj)
    if own is not None:
        add(own)
        attributes += own.values()
    tp = type(obj)
    if isinstance(obj, collections.deque):
        add(Probe(obj, tuple))
    else:
        descriptors = slots.get(tp)
        if descriptors is None:
            descriptors = slots[tp] = _slot_descriptors(tp)
        if descriptors:
            probe = Probe(obj, _read_slots(descriptors))
            add(probe)
            attributes += probe.read(obj)
    if kind in (_PYTREE, _MAPPING):  # their storage: TensorDict._tensordict, UserDict.data
        for value in attributes:
            if isinstance(value, (dict, list)):
                add(value)


def walk(
    root: object,
    name: str,
    is_tensor: Callable[[object], bool] | type,
    keys: Optional[Collection[object]] = None,
    ignore: Collection[object] = (),
    top_keys: Optional[set[Any]] = None,
    chain: Chain = (),
    seen: Optional[dict[int, object]] = None,
    owners: Optional[dict[int, Owner]] = None,
    runs: bool = False,
) -> tuple[list[Union[Leaf, Run]], list[Container]]:
    """All tensor leaves under `root`, and what to watch to notice placements.

    A leaf is a tensor when `is_tensor(leaf)` says so, or, when `is_tensor` is a type
    (cheaper), when it is an instance of it.

    The second list holds the dicts and lists to compare (containers met on the way,
    instance `__dict__`s, storage dicts) and `Probe`s for what only Python can read.
    `keys` and `ignore` filter the top level only (dict keys, sequence indices, field
    names); `top_keys`, if given, receives every top-level key. A container met twice
    (shared or cyclic) is walked once; a tensor reachable by two paths is listed under
    both, in walk order. User code that raises while being read (a Mapping's
    `__getitem__`, a pytree flatten, a property) hides only what it would have given.

    To walk part of a tree again: `chain` is the root's own chain in the whole tree (the
    top-level filters apply only where it is empty), `seen` maps the ids of containers
    not to enter (walked already) to themselves, and receives the ones walked now (held,
    so that no id is reused while it is kept), and `owners` receives, per watched id,
    the `Owner` a store into it changes.

    With `runs`, a list of tensors below the root is one `Run` in the first list, not a
    leaf per tensor (`leaves_of` spells them out).
    """
    leaves: list[Union[Leaf, Run]] = []  # Run only with `runs`
    watched: list[Container] = []
    seen = {} if seen is None else seen
    if isinstance(is_tensor, type):
        tensor_type = is_tensor
        is_tensor = lambda obj: isinstance(obj, tensor_type)  # noqa: E731
    else:
        tensor_type = None
    watched_ids: set[int] = set()
    nodes = _pytree_nodes()
    # The kinds of the types met, per walk (a registration between walks counts); the common
    # ones known up front (a per-sample list of ints costs no `_kind` per walk).
    kinds: dict[type, int] = dict(_COMMON_KINDS) if nodes is None or not any(
        tp in nodes for tp in _COMMON_LEAVES) else {}
    slots: _Slots = {}
    if is_tensor(root):
        return [Leaf(name, cast("torch.Tensor", root), chain)], watched
    if type(root) not in kinds:
        kinds[type(root)] = _kind(type(root), nodes)
    # Depth first, children in order, on an explicit stack (deep chains cannot overflow
    # it). Only tensors and containers are pushed: a wide dict of numbers costs one type
    # lookup per value, with no path built for it.
    stack: list[tuple[object, str, Chain, bool]] = [(root, name, chain, False)]
    while stack:
        obj, path, chain_, is_leaf = stack.pop()
        if is_leaf:
            leaves.append(_leaf((path, obj, chain_)))  # a tensor under two paths appears twice
            continue
        kind = kinds[type(obj)]
        key = id(obj)
        if kind == _LEAF or key in seen:
            continue
        seen[key] = obj
        if kind == _DICT or kind == _LIST:  # `_watch`'s common case, inline
            if key not in watched_ids:
                watched_ids.add(key)
                watched.append(obj)
                if owners is not None:
                    owners[key] = _owner((obj, path, chain_))
        else:
            _watch(obj, kind, watched, watched_ids, slots, _owner((obj, path, chain_)) if owners is not None else None,
                   owners)
        if kind == _LIST and chain_ and tensor_type is not None and runs and _list_tensors_c is not None:
            tensors = _list_tensors_c(obj, tensor_type)  # a list of tensors: one run
            if tensors is not None:
                leaves.append(Run(path, cast("list[object]", obj), chain_, tensors))
                continue
        if kind == _LIST and chain_ and tensor_type is not None and _list_leaves_c is not None:
            found = _list_leaves_c(obj, path, chain_, tensor_type, Leaf)  # a list of tensors, in C
            if found is not None:
                leaves += found
                continue
        try:
            children = _children(obj, kind)
        except Exception:  # noqa: BLE001 - a container whose iteration raises
            continue
        if not chain_:
            children = top_level(children, keys, ignore, top_keys)
        pending = []
        nested = False
        for child in children:
            value = child[1]
            if isinstance(value, tensor_type) if tensor_type is not None else is_tensor(value):
                pending.append((child, True))
                continue
            tp = type(value)
            kind = kinds.get(tp, -1)
            if kind == -1:
                kind = kinds[tp] = _kind(tp, nodes)
            if kind != _LEAF and id(value) not in seen:
                pending.append((child, False))
                nested = True
        if not nested:  # tensors only (a per-sample list): their leaves in order, no trip through the stack
            for (_, value, step, suffix), _ in pending:
                leaves.append(_leaf((path + (suffix if suffix is not None else step_text(step)), value,
                                     chain_ + ((obj, step),))))
            continue
        for (_, value, step, suffix), leaf in reversed(pending):
            stack.append((value, path + (suffix if suffix is not None else step_text(step)),
                          chain_ + ((obj, step),), leaf))
    return leaves, watched


def top_level(children: list[_Child], keys: Optional[Collection[object]], ignore: Collection[object],
              top_keys: Optional[set[Any]]) -> list[_Child]:
    """The root's children that `keys` and `ignore` keep; every key goes into `top_keys`."""
    kept = []
    for child in children:
        key = child[0]
        if top_keys is not None:
            try:
                top_keys.add(key)
            except Exception:  # noqa: BLE001 - unhashable, or an __eq__ that raises
                pass
        if _contains(ignore, key) or (keys is not None and not _contains(keys, key)):
            continue
        kept.append(child)
    return kept


def _contains(collection: Collection[object], key: object) -> bool:
    try:
        return key in collection
    except Exception:  # noqa: BLE001 - a key whose __eq__ or __hash__ raises matches nothing
        return False


_same_values_c: Optional[Callable[[tuple[object, ...], tuple[object, ...]], bool]]
_list_leaves_c: Optional[Callable[..., Optional[list[Leaf]]]]
_list_tensors_c: Optional[Callable[..., Optional[list[torch.Tensor]]]]
try:  # the same check, and the leaves of a list of tensors, in C, when the optional extension built
    from kvguard._native import speedups as _speedups

    _same_values_c, _list_leaves_c = _speedups.same_values, _speedups.list_leaves
except (ImportError, AttributeError):  # pragma: no cover - no compiler at install (or a stale build)
    _same_values_c = _list_leaves_c = None
_list_tensors_c = getattr(_speedups, "list_tensors", None) if _list_leaves_c is not None else None


class Snapshot(NamedTuple):
    """What every watched container held, in a form that is cheap to compare again.

    Holds the containers and (until the next snapshot) the values they held, so no
    address can be reused by a new object while the snapshot is compared against.
    """

    containers: tuple[Container, ...]  # the dicts and lists themselves
    views: tuple[Collection[object], ...]  # each list, and each dict's live `.values()` (the Python check)
    held: tuple[object, ...]  # their values, in order
    probes: tuple[tuple[Probe, Optional[tuple[object, ...]]], ...] = ()  # (probe, what it read): in Python
    probed: bool = False  # whether there are probes (a bool, so `changed` stays one expression)
    ends: tuple[int, ...] = ()  # where each container's values end in `held`
    keys: tuple[object, ...] = ()  # every dict's keys, in order: a renamed key moves paths, not values


def snapshot(containers: list[Container]) -> Snapshot:
    """Remember what every container holds, to notice placements cheaply."""
    plain = tuple(c for c in containers if type(c) is not Probe)
    # dict.values: the dict's own storage order, the order the C check walks (an
    # OrderedDict's .values() follows its links instead)
    views = tuple(dict.values(c) if isinstance(c, dict) else c for c in plain)
    probes = tuple((c, _read(c)) for c in containers if type(c) is Probe)
    ends = tuple(accumulate(map(len, views)))
    return Snapshot(plain, views, tuple(chain.from_iterable(views)), probes, bool(probes), ends, _keys(plain))


def _keys(containers: tuple[Container, ...]) -> tuple[object, ...]:
    return tuple(chain.from_iterable(dict.keys(c) for c in containers if isinstance(c, dict)))


def keys_changed(snap: Snapshot) -> bool:
    """Whether a watched dict's keys changed while its values stayed (`rd["new"] = rd.pop("old")`
    on its last key): no placement, so `changed` does not look, but paths moved.

    Checked only where a report names paths, not before every write.
    """
    now = _keys(snap.containers)
    return len(now) != len(snap.keys) or not all(map(is_, now, snap.keys))


def changed_at(snap: Snapshot) -> list[tuple[Container, tuple[object, ...]]]:
    """The watched containers and probes that changed, each with what it held before."""
    found: list[tuple[Container, tuple[object, ...]]] = []
    start = 0
    same_c = _same_values_c
    for container, view, end in zip(snap.containers, snap.views, snap.ends):
        held = snap.held[start:end]
        start = end
        if len(view) != len(held) or not (same_c((container,), held) if same_c is not None
                                          else all(map(is_, view, held))):
            found.append((container, held))
    found += [(probe, held_ or ()) for probe, held_ in snap.probes if _probe_changed(probe, held_)]
    return found


def appended(container: object, held: tuple[object, ...]) -> Optional[tuple[object, ...]]:
    """What a list gained at its end since it held `held` (its first values still those, by
    identity), or None when it changed otherwise (or is not a list). In C where the extension
    built: a copy of the prefix and one comparison, about a nanosecond a value."""
    if type(container) is not list:
        return None
    n = len(held)
    if len(container) < n:
        return None
    prefix = container[:n]
    if not (_same_values_c((prefix,), held) if _same_values_c is not None else all(map(is_, prefix, held))):
        return None
    return tuple(container[n:])


def new_children(container: object, held: tuple[object, ...]
                 ) -> Optional[tuple[list[tuple[object, object]], list[object]]]:
    """What changed in a dict or list since it held `held`: `(step, value)` of the values
    not where they were, and the values it no longer holds. None for other containers
    (walk them again).

    An append costs one pass of identity comparisons in C; a store or a deletion one pass
    in Python (a deletion shifts what follows, which then counts as new).
    """
    if isinstance(container, list):
        values = list.copy(container)
        steps: Optional[list[object]] = None  # the index
    elif isinstance(container, dict):
        items = list(dict.items(container))
        values = [value for _, value in items]
        steps = [key for key, _ in items]
    else:
        return None
    n = len(held)
    if len(values) >= n and all(map(is_, values, held)):  # appended to (or a no-op)
        return [(i if steps is None else steps[i], values[i]) for i in range(n, len(values))], []
    now = set(map(id, values))
    lost = [value for value in held if id(value) not in now]
    moved = [(i if steps is None else steps[i], value) for i, value in enumerate(values)
             if i >= n or held[i] is not value]
    return moved, lost


def changed(snap: Snapshot) -> bool:
    """Whether any watched container gained, lost or replaced a value.

    On the path of every write op: one identity comparison of every value, in C (the
    `kvguard._native.speedups` extension, about a nanosecond a value) or, without it, in `map`/`all`.
    A value that moved from one container to another is not a change: nothing new
    became reachable.
    """
    if _same_values_c is not None:  # slots and deques: only guards that hold one pay for probes
        return not _same_values_c(snap.containers, snap.held) or snap.probed and _probes_changed(snap)
    return _changed_py(snap) or snap.probed and _probes_changed(snap)


def _changed_py(snap: Snapshot) -> bool:
    views = snap.views
    return sum(map(len, views)) != len(snap.held) or not all(map(is_, chain.from_iterable(views), snap.held))


def _read(probe: Probe) -> Optional[tuple[object, ...]]:
    try:
        return probe.read(probe.obj)
    except Exception:  # noqa: BLE001 - a deque mutated while read
        return None


def _probes_changed(snap: Snapshot) -> bool:
    return any(_probe_changed(probe, held) for probe, held in snap.probes)


def _probe_changed(probe: Probe, held: Optional[tuple[object, ...]]) -> bool:
    now = _read(probe)
    if now is None or held is None:
        return now is not held
    return len(now) != len(held) or not all(map(is_, now, held))
