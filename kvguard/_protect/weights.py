"""A model's weights as a protected set: `guard_module`'s tensors.

Every parameter and buffer of the guarded modules, named as `named_parameters()` and
`named_buffers()` print them under the guard's name (`model.layers.0.mlp.weight`), read
again at each boundary (a parameter replaced or added), and held for as long as a module,
or an optimizer that holds them (`holder`), does. Writes a trainer means are not reported:
an optimizer's step (`weights_steps`, the set's lowest layer), and what the writing op's
stack shows to be a module's own, a load's included (`weights_writers`, its top layer
below this one). What a rollout engine receives for its weights is protected beside them
(`weights_received`, the layer between).
"""

from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING, Callable, Hashable, NamedTuple, Optional, Sequence, Union

import torch

from kvguard._protect.collector import collector_paused
from kvguard._protect.entries import Change, Entry
from kvguard._protect.weights_writers import IntendedWritesSet

if TYPE_CHECKING:
    from kvguard._protect.contract import Protected

class _Root(NamedTuple):
    name: str
    ref: Callable[[], Union[torch.nn.Module, torch.Tensor, None]]  # weak, to the module (or the loose parameter)
    holders: Optional[set[Hashable]]


class ModuleSet(IntendedWritesSet):
    """The parameters and buffers of `modules` (name, module), protected as entries."""

    lets_go_of_what_left = False  # a module's weights are its own: what it held stays protected
    holds_weights = True  # a blocked write's hint names the optimizer step

    def __init__(self, modules: Sequence[tuple[str, torch.nn.Module]], fingerprint: bool = True) -> None:
        # (name, module, holders) of each guarded module, and of each parameter no named module
        # holds: holders are the optimizers (their keys) it is protected for, None for the
        # guard's life. Holders let go wait in `_released` (a finalizer may run on any thread).
        self._roots: list[_Root] = [_Root(n, weakref.ref(m), None) for n, m in modules]
        self._loose: list[_Root] = []
        self._released: list[Hashable] = []
        super().__init__(modules[0][0] if modules else "model", fingerprint)

    # -- entries ---------------------------------------------------------------------

    def _root_modules(self) -> list[torch.nn.Module]:
        return [root for _, ref, _ in self._roots if isinstance(root := ref(), torch.nn.Module)]

    def _named_tensors(self) -> list[tuple[str, torch.Tensor, Optional[torch.nn.Module]]]:
        """(path, tensor, the module whose forward may write it, if any) of every module's parameters
        and buffers, each tensor once."""
        found: list[tuple[str, torch.Tensor, Optional[torch.nn.Module]]] = []
        seen: set[int] = set()
        modules: set[int] = set()
        tied: set[int] = set()  # a tensor held under two names (a tied embedding)
        for name, ref, _ in self._roots:
            root = ref()
            if not isinstance(root, torch.nn.Module):
                continue
            for prefix, module in root.named_modules(prefix=name):
                modules.add(id(module))
                own_params = type(module).__module__.startswith("torch.nn.")
                for pname, param in module.named_parameters(recurse=False):
                    if id(param) not in seen:
                        seen.add(id(param))
                        found.append((f"{prefix}.{pname}", param, module if own_params else None))
                    else:
                        tied.add(id(param))
                for bname, buf in module.named_buffers(recurse=False):
                    if buf is not None and id(buf) not in seen:
                        seen.add(id(buf))
                        found.append((f"{prefix}.{bname}", buf, module))
                    elif buf is not None:
                        tied.add(id(buf))
        for path, loose, _ in self._loose:
            tensor = loose()
            if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                seen.add(id(tensor))
                found.append((path, tensor, None))
        self._guarded_modules = modules
        self._tied = tied
        return found

    def add(self, modules: Sequence[tuple[str, torch.nn.Module]], loose: Sequence[tuple[str, torch.Tensor]] = (),
            holder: Optional[Hashable] = None) -> None:
        """Protect more modules (and parameters no module holds) from now on, for `holder` (an
        optimizer's key: until `holder_gone(holder)`; None: for the guard's life)."""
        for name, obj in modules:
            self._hold(self._roots, name, obj, holder)
        for path, tensor in loose:
            self._hold(self._loose, path, tensor, holder)
        with collector_paused():
            self._scan_now(None)

    @staticmethod
    def _hold(roots: list[_Root], name: str, obj: Union[torch.nn.Module, torch.Tensor],
              holder: Optional[Hashable]) -> None:
        for i, root in enumerate(roots):
            if root.ref() is obj:
                if holder is None:
                    roots[i] = root._replace(holders=None)
                elif root.holders is not None:
                    root.holders.add(holder)
                return
        roots.append(_Root(name, weakref.ref(obj), None if holder is None else {holder}))

    def holder_gone(self, holder: Hashable) -> None:
        """`holder` is gone (an optimizer freed): what only it held is let go at the next look."""
        self._released.append(holder)
        self._dirty = True

    def _must_look(self) -> bool:
        return bool(self._released) or self._dirty

    def _drop_released_holders(self) -> None:
        released = set(self._released)
        del self._released[: len(released)]
        for roots in (self._roots, self._loose):
            for root in roots:
                if root.holders is not None:
                    root.holders.difference_update(released)
            roots[:] = [r for r in roots if r.holders is None or r.holders]
        self._scan_now(None)

    def _scan_now(self, frames: Optional[list[types.FrameType]]) -> None:
        """Every parameter and buffer as the modules hold them now: new ones protected, replaced ones let go."""
        self._dirty = False
        self._forget_steps()
        self._drop_dead()
        named = self._named_tensors()
        entries = self._entries
        kept = {id(t) for _, t, _ in named} | self._received_ids()  # what a load was handed stays too
        for key in [k for k in entries if k not in kept]:  # a parameter the module no longer holds
            self._owner.pop(id(entries.pop(key)), None)
        new = [(path, t, owner) for path, t, owner in named
               if (e := entries.get(id(t))) is None or e.ref() is not t]
        if new:
            records = self._records_of([t for _, t, _ in new])
            for (path, tensor, owner), record in zip(new, records):
                entry = entries[id(tensor)] = Entry(path, record, weakref.ref(tensor, self._on_death), None)
                if owner is not None:
                    self._owner[id(entry)] = weakref.ref(owner)
            self.protected_count += len(new)
        for path, tensor, _ in named:  # a renamed or re-registered module: its path as it is now
            known = entries.get(id(tensor))
            if known is not None and known.path != path:
                known.path = path
        self._rebuild_index()

    def _drop_dead(self) -> bool:
        weights_died = any(e.ref() is None and not self.is_received(e) for e in self._entries.values())
        dropped = super()._drop_dead()
        if weights_died:  # (what a load was handed dies one by one: the weights' caches stand)
            self._forget_steps()  # keyed by the ids of tensors, one of which died
            self._own_writes = None
        return dropped

    def look(self) -> None:
        if self._released:
            with collector_paused():
                self._drop_released_holders()
        elif self._dirty:
            self._forget_dead()

    def settle(self) -> None:
        """Paths are the modules' names, kept current by each scan."""

    def boundary_changes(self, caller: Optional[types.FrameType], rescan: bool = True) -> list[Change]:
        """At a boundary the modules are read again (a parameter replaced or added), then compared."""
        self._reclaim()
        with collector_paused():
            self._scan_now(None)
        self._settle()
        self._absorb_own_updates()
        found = super().boundary_changes(caller, rescan=False)
        early, self._early = self._early, []
        later = [Change(e, t, "values", None, None) for e in self._later.collect() if (t := e.ref()) is not None]
        return early + later + found

    def close(self) -> None:
        self._roots = []
        super().close()


if TYPE_CHECKING:
    _meets: type[Protected] = ModuleSet  # mypy checks the set against the contract here
