"""`guard_module()`: protect a model's parameters and buffers outside the writes a trainer means.

A `Guard` whose protected set is `kvguard._protect.weights.ModuleSet`. Each optimizer
given has its `step` wrapped on the instance for the block, so that the step's own writes
pass without a look (see `ModuleSet.begin_step`); the other intended writes are read from
the stack when they happen.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Collection, Literal, Optional, Protocol

from kvguard._guard.guard import Guard
from kvguard._guard.target import caller_name

if TYPE_CHECKING:
    import types

    import torch

    from kvguard._protect.entries import Change
    from kvguard._protect.weights import ModuleSet
    from kvguard._protect.weights_steps import StepSet

Modules = list[tuple[str, "torch.nn.Module"]]  # (name, module): whose weights, under which names
Loose = list[tuple[str, "torch.Tensor"]]  # (name, parameter) of parameters no named module holds


class Optimizer(Protocol):
    """What a weights guard uses of an optimizer: a `torch.optim.Optimizer`, or any object with
    its `param_groups` and a `step()` (as `guard_module` checks)."""

    param_groups: list[dict[str, Any]]  # each group's options (`lr`...) and its "params"

    def step(self, *args: Any, **kwargs: Any) -> object: ...


STEP_DIFF = ("values changed since the last optimizer step with no dispatched write (a numpy view, a raw "
             "pointer, another thread?), found before this step would absorb it: the writing line is not known")
STEP_DIFF_LIGHT = ("values changed since the last optimizer step, found before this step would absorb it "
                   "(level='light' watches no op, so the writing line is not known: level='full' names it)")
MEMORY_DIFF = "identity or memory changed since the last optimizer step with no dispatched op"
APPLY_DIFF = ("values replaced by Module._apply, which re-points them with `.data =` (no dispatched op): not a "
              "dtype or device conversion (to_empty leaves uninitialised memory)")


def _nothing() -> None:
    pass


def _digest(digest: Any) -> str:
    try:
        return f"{int(digest) & ((1 << 64) - 1):016x}"
    except Exception:  # noqa: BLE001 - a device digest or a tuple: not worth a line
        return ""


class ModuleGuard(Guard):
    """A guard over the weights of one module. Use `guard_module()`."""

    intended_for = "weights"  # peft's merge, trl's reference sync... (`kvguard._intended`)
    _protected: Optional[ModuleSet]

    def __init__(self, modules: Modules, optimizers: tuple[Optimizer, ...], *, name: Optional[str] = None,
                 action: Optional[str] = "raise", allow: Optional[Collection[str]] = None,
                 report_dir: Optional[str | os.PathLike[str]] = None, level: Optional[str] = None,
                 fingerprint: Optional[bool] = None, target: Optional[str] = None) -> None:
        super().__init__([], name=name or "model", action=action, allow=allow, report_dir=report_dir,
                         level=level, fingerprint=fingerprint, target=target)
        self.modules = modules  # (name, module): whose parameters and buffers, under which names
        self.optimizers = optimizers
        self._unwrap: list[Callable[[], None]] = []
        # id(optimizer) -> (weak ref, its holder key)
        self._holder_of: dict[int, tuple[weakref.ref[Optimizer], int]] = {}

    def _new_protected(self) -> ModuleSet:
        from kvguard._protect.weights import ModuleSet

        if self.level == "full":
            # The engine first, as `Guard._new_protected` does: choosing the compiled one loads
            # the extension, and a set reads its records from one source for its whole life
            # (`records.describe`). Made before it, the first guard of a process would read
            # them in Python at every write it looks at (a batch norm's statistics: ~2x).
            from kvguard._engine import choice as _choice

            _choice.choose()
        return ModuleSet(self.modules, fingerprint=self.fingerprint)

    def __enter__(self) -> ModuleGuard:
        from kvguard._torch import patches as _patches

        super().__enter__()
        for optimizer in self.optimizers:
            self._unwrap.append(_wrap_step(optimizer, self))
        protected = weakref.ref(self._protected)  # conversions (`model.half()`) are the trainer's writes
        me = weakref.ref(self)

        def converting(module: torch.nn.Module, fn: object) -> Callable[[], None]:
            live = protected()
            if live is None:
                return _nothing
            after = live.converting(module, fn)

            def done() -> None:
                guard = me()
                try:
                    changes = after()
                except Exception:  # noqa: BLE001 - kvguard's own failure never fails the user's `_apply`
                    return
                if guard is not None:
                    guard._report_changes(changes, APPLY_DIFF, f"when {type(module).__name__}._apply returned "
                                                               "(to_empty, or a function keeping dtype and device)")
            return done

        def loaded(module: torch.nn.Module) -> None:
            live = protected()
            if live is not None:
                live.converted(module)
        self._unwrap.append(_patches.on_module_conversion(converting))
        if self.level != "full":  # no op is seen: the intended writes the stack would show, seen otherwise
            assert self._protected is not None  # made as the guard was entered
            self._protected.light = True
            self._unwrap.append(_patches.on_load_state_dict(loaded))
        return self

    @property
    def buffer_count(self) -> int:
        """The receive buffers its set has watched for refills so far (0 outside the guard)."""
        return self._protected.buffer_count if self._protected is not None else 0

    def add_optimizer(self, optimizer: Optimizer, modules: Modules, loose: Loose) -> None:
        """An optimizer made while the guard is active (KVGUARD_TARGETS=weights): its weights from now
        on, until it is freed (unless something else holds them too)."""
        if self._protected is None:
            return
        # Its own key, never its id: a new optimizer may get a freed one's id before the set lets
        # go of what the freed one held (it does so at its next look), and would lose it too.
        key = next(_holder_keys)
        self._holder_of[id(optimizer)] = (weakref.ref(optimizer), key)
        self._protected.add(modules, loose, holder=key)
        self._unwrap.append(_wrap_step(optimizer, self))
        weakref.finalize(optimizer, self._optimizer_freed, id(optimizer), key)

    def add_params(self, optimizer: Optimizer, modules: Modules, loose: Loose) -> None:
        """Parameters added to a watched optimizer (`add_param_group`): protected for it as its others."""
        held = self._holder_of.get(id(optimizer))
        if self._protected is not None and held is not None and held[0]() is optimizer:
            self._protected.add(modules, loose, holder=held[1])

    def _optimizer_freed(self, address: int, key: int) -> None:
        held = self._holder_of.get(address)
        if held is not None and held[1] == key:
            del self._holder_of[address]
        if self._protected is not None:
            self._protected.holder_gone(key)

    def add_modules(self, modules: Modules) -> None:
        """Modules loaded while the guard is active (KVGUARD_TARGETS=weights): their weights from now on."""
        if self._protected is not None:
            self._protected.add(modules)

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[types.TracebackType]) -> Literal[False]:
        while self._unwrap:
            self._unwrap.pop()()
        self.modules, self.optimizers = [], ()  # a guard left behind (its cycles wait for gc) holds neither
        return super().__exit__(exc_type, exc, tb)

    def stepping(self, optimizer: Optimizer) -> Optional[StepSet]:
        """Called by the wrapped `step` of `optimizer` before it runs: what changed in its parameters
        since the last step with no op reporting it is reported (the step would absorb it; under
        "raise" the step does not run), then they step aside; returns the token `stepped` takes
        after it (None: the guard is gone)."""
        protected = self._protected
        if protected is None or self._sampled_out:  # the sampled tier: this interval is not checked
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        step = protected.step_set(params)
        self._report_changes(protected.step_changes(step, params),
                             STEP_DIFF if self.level == "full" else STEP_DIFF_LIGHT,
                             f"at optimizer step {protected.steps + 1}, before it ran")
        return protected.begin_step(step, params)

    def _report_changes(self, changes: list[Change], diff: str, found: str) -> None:
        """Changes found at a step or a module's `_apply`, as boundary findings located at the user's
        line (`step()`, `to_empty()`) and said to be found there (`found`, the event's). Under "raise"
        the first raises (the change has happened)."""
        if not changes or self._protected is None:
            return
        from kvguard._engine.judge import unobserved_event
        from kvguard._report.events import MutationError
        from kvguard._protect.frames import user_site
        from kvguard._report.events import format_event

        site = user_site()
        events = [unobserved_event(c.entry, c.tensor, site, diff, f"digest {_digest(c.was)}") if c.kind == "values" else
                  unobserved_event(c.entry, c.tensor, site, MEMORY_DIFF, c.was, c.now) for c in changes]
        events = [dataclasses.replace(e, found=found) for e in events]
        events = [e for e in events if not self._allowed(e)]
        for event in events:
            self._on_event(event, at_exit=True)
        if events and self.action == "raise":
            raise MutationError(format_event(events[0]), events[0], self.report)

    def stepped(self, token: Optional[StepSet]) -> None:
        if token is not None and self._protected is not None:
            self._protected.end_step(token)


_holder_keys = itertools.count(1)  # what a protected set knows each optimizer by


def _wrap_step(optimizer: Optimizer, guard: ModuleGuard) -> Callable[[], None]:
    """Wrap `optimizer.step` on the instance for the guard's block; returns the undo.

    A wrapper added on top later (an LR scheduler made inside the block wraps `step` too)
    cannot be taken off from under it: ours then stays and passes straight through.
    Nothing here holds the optimizer strongly, the instance's own `step` included: a
    reference cycle would keep it (and its state) alive after `del opt`.
    """
    from kvguard._torch import compiled as _compiled

    own = vars(optimizer).get("step")  # an LR scheduler's wrapper already (it holds the optimizer weakly)
    # Called with the optimizer, if not its own.
    inner: Callable[..., object] = own if own is not None else type(optimizer).step
    active: list[Optional[ModuleGuard]] = [guard]  # None once undone: nothing of the guard kept alive
    optimizer_ref = weakref.ref(optimizer)

    @functools.partial(_compiled.outside_dynamo, callees=True)
    def run(self: Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        return inner(*args, **kwargs) if own is not None else inner(self, *args, **kwargs)

    @functools.wraps(getattr(inner, "__func__", inner))
    def step_method(self: Optimizer, *args: object, **kwargs: object) -> object:
        owner = active[0]
        if owner is None:
            return run(self, args, kwargs)
        token = owner.stepping(self)
        try:
            return run(self, args, kwargs)
        finally:
            owner.stepped(token)

    # Bound as torch's LR schedulers expect of `optimizer.step` (they wrap its `__func__`), weakly.
    # The undo knows it by a marker, not by the function. Inside `torch.compile`d code the
    # wrapper runs eagerly (the guard's bookkeeping is no graph) and the step it calls is
    # compiled as without kvguard: the same graphs and graph breaks.
    marker = step_method._kvguard_step = object()  # type: ignore[attr-defined]
    optimizer.step = WeaklyBound(  # type: ignore[method-assign]  # on the instance, as LR schedulers do
        _compiled.outside_dynamo(step_method, callees=True), optimizer)
    _step_outside_dynamo()
    del step_method

    def undo() -> None:
        active[0] = None
        opt = optimizer_ref()
        if opt is not None and getattr(getattr(vars(opt).get("step"), "__func__", None), "_kvguard_step", None) \
                is marker:
            if own is not None:
                opt.step = own  # type: ignore[method-assign]
            else:
                del opt.step
    return undo


def _step_outside_dynamo() -> None:
    """The step wrapper's frames and the guard's bookkeeping run eagerly under `torch.compile`
    (marked once, when torch is there): Dynamo neither traces them nor breaks a graph inside them."""
    from kvguard._torch import compiled as _compiled

    if not getattr(ModuleGuard.stepping, "_torchdynamo_disable", False):
        ModuleGuard.stepping = _compiled.outside_dynamo(ModuleGuard.stepping)  # type: ignore[method-assign]
        ModuleGuard.stepped = _compiled.outside_dynamo(ModuleGuard.stepped)  # type: ignore[method-assign]
        WeaklyBound.__call__ = _compiled.outside_dynamo(WeaklyBound.__call__, callees=True)  # type: ignore[method-assign]


class WeaklyBound:
    """A method bound to an object it holds weakly: what `types.MethodType` is, without the strong
    reference that makes a reference cycle when it is stored on that object. Other attributes
    are the function's (an LR scheduler's `_wrapped_by_lr_sched`)."""

    __slots__ = ("__func__", "_ref")

    def __init__(self, func: Callable[..., object], obj: object) -> None:
        self.__func__ = func
        self._ref = weakref.ref(obj)

    @property
    def __self__(self) -> object:
        return self._ref()

    def __call__(self, *args: object, **kwargs: object) -> object:
        obj = self._ref()
        if obj is None:
            raise ReferenceError("the object this method was bound to is gone")
        return self.__func__(obj, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__func__, name)

    def __repr__(self) -> str:
        return f"<bound method {getattr(self.__func__, '__qualname__', '?')} of {self._ref()!r}>"


def guard_module(module: torch.nn.Module, optimizer: Any = None, *, action: str = "raise", name: Optional[str] = None,
                 allow: Optional[Collection[str]] = None, report_dir: Optional[str | os.PathLike[str]] = None,
                 level: Optional[str] = None, fingerprint: Optional[bool] = None) -> ModuleGuard:
    """Protect every parameter and buffer of `module` while the `with` block runs.

    Paths are the names `named_parameters()` and `named_buffers()` print, under the
    guard's name (`model.layers.0.mlp.weight`). The writes a trainer means pass without a
    report: inside `step()` of each optimizer given, inside `load_state_dict` of the module
    (or one of its submodules), a module's own `forward` updating its own buffers (batch
    norm's running statistics), and DistributedDataParallel's broadcasts of them. Any
    other write is reported at the op (under "raise", stopped before it); what no op shows
    (`p.data = other`, a raw pointer) at the boundary (exit, `g.check()`).

    Args:
        module: a `torch.nn.Module`.
        optimizer: an optimizer, or a list of them, whose `step()` may write the weights;
            None: no step is expected (an inference-side model).
        action: "raise", "warn" or "record", as for `kvguard.guard`.
        name: how paths start (`model.layers.0.mlp.weight`); defaults to how the caller
            wrote `module`.
        allow: paths whose writes are intended, as for `kvguard.guard`.
        report_dir: write report files here.
        level: "full" or "light", as for `kvguard.guard`.
        fingerprint: compare the weights' values at the boundaries; default on.

    Example::

        with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
            for batch in loader:
                train_step(model, opt, batch)
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        kind = type(module)
        raise TypeError(f"kvguard.guard_module() protects a torch.nn.Module's parameters and buffers; got "
                        f"{kind.__module__}.{kind.__qualname__} (for tensors in a dict or list, use kvguard.guard)")
    optimizers = () if optimizer is None else tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (
        optimizer,)
    for opt in optimizers:
        if not hasattr(opt, "param_groups") or not callable(getattr(opt, "step", None)):
            kind = type(opt)
            raise TypeError(f"kvguard.guard_module(optimizer=...) takes torch optimizers (with param_groups and "
                            f"step()); got {kind.__module__}.{kind.__qualname__}")
    name = name if name is not None else caller_name(module)
    return ModuleGuard([(name, module)], optimizers, name=name, action=action, allow=allow, report_dir=report_dir,
                       level=level, fingerprint=fingerprint)
