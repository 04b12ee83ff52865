"""`guard_autograd()`: protect what autograd saved for backward, with no tensor named.

A `Guard` whose protected set is `kvguard._protect.saved.SavedSet`, fed by a pair of
`saved_tensors_hooks` installed for the block. Where other saved-tensor hooks are already
active (`save_on_cpu`, checkpointing, `allow_mutation_on_saved_tensors`), backward reads
what they kept, not the tensors: the guard installs nothing and protects nothing, and
says so. Hooks installed inside the block (checkpointing, `save_on_cpu`, offloading) are
composed with the guard's (`saved.Composed`), since hooks do not nest; those that
`torch.compile` inlines are left alone and counted. `torch.func`'s transforms refuse
saved-tensor hooks: inside one, the guard's are set aside (see `_patches.let_func_transforms_run`)
and the stretch is counted as unprotected.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Collection, Literal, Optional

from kvguard._errors import GuardWarning
from kvguard._guard.guard import Guard
from kvguard._kinds import AUTOGRAD
from kvguard._report.tally import unprotected_text
from kvguard._text import plural

if TYPE_CHECKING:
    from kvguard._protect.saved import SavedSet


class AutogradGuard(Guard):
    """A guard over every tensor saved for backward while it is active. Use `guard_autograd()`."""

    # Writes torch makes on purpose and undoes before backward reads them (gradcheck's
    # perturbation): allowed with no setting, as data in `kvguard._intended`.
    intended_for = "autograd"
    kind = AUTOGRAD
    _protected: Optional[SavedSet]

    def __init__(self, *, name: Optional[str] = None, action: Optional[str] = "raise",
                 allow: Optional[Collection[str]] = None, report_dir: Optional[str | os.PathLike[str]] = None,
                 target: Optional[str] = None) -> None:
        allow = [allow] if isinstance(allow, str) else list(allow or ())
        super().__init__([], name=name or "autograd", action=action, allow=allow,
                         report_dir=report_dir, target=target, level="full", fingerprint=False)
        self.delegated = False  # other saved-tensor hooks were active: nothing protected
        self._hooks: Any = None
        self._outer: Any = None  # the SavedSet of a guard_autograd this one was entered inside
        self.inside_func_transform = False  # entered where saved-tensor hooks are refused (torch.func)
        self.graphs = 0  # graphs that saved tensors under the guard (set at exit)
        self.unprotected = 0  # stretches under other saved-tensor hooks left unprotected (set at exit)

    def _new_protected(self) -> Any:
        from kvguard._protect.saved import SavedSet

        return SavedSet(self.name)

    def __enter__(self) -> AutogradGuard:
        from kvguard._torch import autograd as _autograd
        from kvguard._torch import patches as _patches
        from kvguard._protect import saved as _saved

        _patches.let_func_transforms_run(_saved.is_own_pack, _saved.count_set_aside)
        _patches.compose_saved_tensors_hooks(_saved.compose)
        pack = _autograd.top_saved_tensors_pack()
        outer = _saved.set_of(pack) if pack is not None else None
        self._outer = outer if outer is not None and not outer.closed else None
        self.inside_func_transform = _autograd.saved_tensors_hooks_disabled()
        self.delegated = self._outer is None and (pack is not None or _autograd.allowing_mutation_on_saved_tensors()
                                                  or self.inside_func_transform)
        super().__enter__()
        if self._outer is not None:  # inside another guard_autograd: its packs are this one's too
            self._outer.followers.append(self._protected)
            self._outer._sync()  # its packs go through Python while they are this one's too
        elif not self.delegated:
            import torch

            assert self._protected is not None  # made as the guard was entered
            self._hooks = torch.autograd.graph.saved_tensors_hooks(*self._protected.hooks())
            self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        outer, self._outer = self._outer, None
        if outer is not None and self._protected in outer.followers:
            outer.followers.remove(self._protected)
            outer._sync()
        if self._protected is not None:
            self.graphs = self._protected.graphs
            self.unprotected = self._protected.unprotected
        return super().__exit__(exc_type, exc, tb)

    def sample_out(self) -> None:
        """Unchecked by the sampled tier: no saved-tensor hooks either (what was saved while checked
        keeps its unpack hook), when ours are the innermost; else they stay, and so does the cost."""
        super().sample_out()
        from kvguard._protect import saved as _saved
        from kvguard._torch import autograd as _autograd

        pack = _autograd.top_saved_tensors_pack()
        if self._hooks is not None and pack is not None and _saved.set_of(pack) is self._protected \
                and threading.get_ident() == self._thread:  # saved-tensor hooks are per thread
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def sample_in(self) -> None:
        """Checked again: our hooks back on, unless other hooks are active now (a step inside
        `save_on_cpu`): pushed on top of theirs, ours would be what their exit pops. That interval
        is then counted unprotected (said at exit), and the next checked one tries again."""
        super().sample_in()
        if self._hooks is None and not self.delegated and self._outer is None and self._protected is not None \
                and threading.get_ident() == self._thread:
            from kvguard._torch import autograd as _autograd

            if _autograd.top_saved_tensors_pack() is not None:
                self._protected.unprotected += 1
                return
            import torch

            self._hooks = torch.autograd.graph.saved_tensors_hooks(*self._protected.hooks())
            self._hooks.__enter__()

    def _warn_if_blind(self) -> None:
        if self.unprotected:
            self._warn(f"kvguard.guard_autograd(): {unprotected_text(self.unprotected)}", GuardWarning)
        if self.inside_func_transform and self._outer is None:
            self._warn("kvguard.guard_autograd() protected no tensor: it began inside a torch.func transform "
                       "(grad, vjp, jacrev, hessian), where saved-tensor hooks are refused; enter it outside the "
                       "transform", GuardWarning)
        elif self.delegated:
            self._warn("kvguard.guard_autograd() protected no tensor: other saved_tensors_hooks were active when "
                       "it began (save_on_cpu, checkpointing, allow_mutation_on_saved_tensors, offloading), so "
                       "backward reads what they kept; enter guard_autograd outside them", GuardWarning)
        elif self.protected_count == 0 and not self.unprotected:
            self._warn("kvguard.guard_autograd() protected no tensor: no op saved one for backward while it was "
                       "active (torch.no_grad(), inference_mode, or no tensor requiring grad?)", GuardWarning)

    def __repr__(self) -> str:
        return super().__repr__().replace("kvguard.guard ", "kvguard.guard_autograd ", 1)




def guard_autograd(*, action: str = "raise", name: Optional[str] = None, allow: Optional[Collection[str]] = None,
                   report_dir: Optional[str | os.PathLike[str]] = None) -> AutogradGuard:
    """Protect every tensor an op saves for backward while the `with` block runs.

    From the moment it is saved until the backward that needs it has run (or its graph is
    freed), a write to a saved tensor is reported at the writing line, like any kvguard
    event: its path names the saving node and slot (`<saved by SigmoidBackward0: result>`),
    `placed_at` the forward line that saved it. A write that changes no saved element but
    bumps the version counter a saved tensor shares (a sibling slice of its base) is
    reported with `kind="version"`: backward would fail on it just the same. Under
    "raise" both are stopped before the write, so backward still works.

    Autograd's own check stays on: a write let through ("warn", "record") still makes
    backward raise "modified by an inplace operation", now with the write kvguard saw.

    Args:
        action: "raise", "warn" or "record", as for `kvguard.guard`.
        name: how reports name the guard; default "autograd".
        allow: paths whose writes are intended (`"<saved by SigmoidBackward0: *"` style
            patterns, as reports print them).
        report_dir: write report files here; default: none (`KVGUARD_REPORT_DIR`).

    Example::

        with kvguard.guard_autograd(action="raise") as g:
            loss = compute_loss(model(batch))
            loss.backward()
    """
    return AutogradGuard(name=name, action=action, allow=allow, report_dir=report_dir)
