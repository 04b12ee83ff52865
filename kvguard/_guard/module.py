"""`guard_module()`: protect a model's parameters and buffers outside the writes a trainer means.

A `Guard` whose protected set is `kvguard._protect.weights.ModuleSet`. Each optimizer
given has its `step` wrapped on the instance for the block, so that the step's own writes
pass without a look (see `ModuleSet.begin_step`); the other intended writes are read from
the stack when they happen.
"""

from __future__ import annotations

import functools
import os
import types
import weakref
from typing import Any, Collection, Literal, Optional

from kvguard._guard.guard import Guard
from kvguard._guard.target import caller_name


class ModuleGuard(Guard):
    """A guard over the weights of one module. Use `guard_module()`."""

    def __init__(self, modules: list[tuple[str, Any]], optimizers: tuple[Any, ...], *, name: Optional[str] = None,
                 action: Optional[str] = "raise", allow: Optional[Collection[str]] = None,
                 report_dir: Optional[str | os.PathLike[str]] = None, level: Optional[str] = None,
                 fingerprint: Optional[bool] = None, target: Optional[str] = None) -> None:
        super().__init__([], name=name or "model", action=action, allow=allow, report_dir=report_dir,
                         level=level, fingerprint=fingerprint, target=target)
        self.modules = modules  # (name, module): whose parameters and buffers, under which names
        self.optimizers = optimizers
        self._unwrap: list[Any] = []

    def _new_protected(self) -> Any:
        from kvguard._protect.weights import ModuleSet

        return ModuleSet(self.modules, fingerprint=self.fingerprint)

    def __enter__(self) -> ModuleGuard:
        from kvguard import _torch

        super().__enter__()
        for optimizer in self.optimizers:
            self._unwrap.append(_wrap_step(optimizer, self))
        protected = weakref.ref(self._protected)  # conversions (`model.half()`) are the trainer's writes

        def converted(module: Any) -> None:
            live = protected()
            if live is not None:
                live.converted(module)
        self._unwrap.append(_torch.on_module_conversion(converted))
        return self

    def add_optimizer(self, optimizer: Any, modules: list[tuple[str, Any]], loose: list[tuple[str, Any]]) -> None:
        """An optimizer made while the guard is active (KVGUARD_TARGETS=weights): its weights from now
        on, until it is freed (unless something else holds them too)."""
        if self._protected is None:
            return
        self._protected.add(modules, loose, holder=id(optimizer))
        self._unwrap.append(_wrap_step(optimizer, self))
        weakref.finalize(optimizer, self._optimizer_freed, id(optimizer))

    def _optimizer_freed(self, key: int) -> None:
        if self._protected is not None:
            self._protected.holder_gone(key)

    def add_modules(self, modules: list[tuple[str, Any]]) -> None:
        """Modules loaded while the guard is active (KVGUARD_TARGETS=weights): their weights from now on."""
        if self._protected is not None:
            self._protected.add(modules)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        while self._unwrap:
            self._unwrap.pop()()
        self.modules = []
        return super().__exit__(exc_type, exc, tb)

    def stepping(self, optimizer: Any) -> Any:
        """Called by the wrapped `step` of `optimizer` before it runs: its parameters step aside; returns
        the token `stepped` takes after it (None: the guard is gone)."""
        protected = self._protected
        if protected is None:
            return None
        return protected.begin_step(p for group in optimizer.param_groups for p in group["params"])

    def stepped(self, token: Any) -> None:
        if token is not None and self._protected is not None:
            self._protected.end_step(token)


def _wrap_step(optimizer: Any, guard: ModuleGuard) -> Any:
    """Wrap `optimizer.step` on the instance for the guard's block; returns the undo.

    A wrapper added on top later (an LR scheduler made inside the block wraps `step` too)
    cannot be taken off from under it: ours then stays and passes straight through. The
    undo holds the optimizer weakly: a guard never keeps one alive.
    """
    had_own = "step" in vars(optimizer)  # an LR scheduler's wrapper already (it holds the optimizer weakly)
    inner = optimizer.step
    active: list[Optional[ModuleGuard]] = [guard]  # None once undone: nothing of the guard kept alive
    optimizer_ref = weakref.ref(optimizer)

    @functools.wraps(inner)
    def step_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        owner = active[0]
        if owner is None:
            return inner(*args, **kwargs)
        token = owner.stepping(self)
        try:
            return inner(*args, **kwargs)
        finally:
            owner.stepped(token)

    # A bound method, as torch's LR schedulers expect of `optimizer.step` (they wrap its `__func__`).
    # The undo knows it by a marker, not by the function (which holds the inner bound step).
    marker = step_method._kvguard_step = object()  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(step_method, optimizer)
    del step_method

    own = inner if had_own else None  # the undo holds the inner step only where the instance had its own

    def undo() -> None:
        active[0] = None
        opt = optimizer_ref()
        if opt is not None and getattr(getattr(vars(opt).get("step"), "__func__", None), "_kvguard_step", None) \
                is marker:
            if own is not None:
                opt.step = own
            else:
                del opt.step
    return undo


def guard_module(module: Any, optimizer: Any = None, *, action: str = "raise", name: Optional[str] = None,
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
