"""The sampled tier (`KVGUARD_SAMPLE=1/100`): which units are checked fully.

A unit is one guarded call of a target, or one optimizer step's interval (the forward,
backward and step between two steps, for `weights`, `autograd` and `data`). Sampling is
stratified: the units are cut into blocks of `every`, and one unit of each block, chosen by
a hash of the seed, the unit's name and the block, is checked; the first `first` units are
always checked, so short jobs and tests are fully covered. Hence a bug that fires on every
unit is caught within `first + 2 * every` units whatever the seed, a job's count of checked
units is exact, and every rank of one launch checks the same units: the seed is the run id
torchrun and `kvguard run` give all of them, unless `KVGUARD_SAMPLE` names one.

Units the sample leaves out run on the path kvguard's full tier takes for code it does not
guard: no guard is entered, no saved-tensor hook installed, no snapshot taken.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Callable, Optional

from kvguard._config import Sample, guard_defaults


def sample() -> Sample:
    """The process's `KVGUARD_SAMPLE` (every unit when unset): as env activation read it at start-up,
    which a job changing its variables later cannot undo; else as the variable says now."""
    from kvguard._state import STATE

    if STATE.started and STATE.settings is not None:
        return STATE.settings.defaults.sample  # type: ignore[no-any-return]
    return guard_defaults().sample


def checks(setting: Sample, unit: str, index: int) -> bool:
    """Whether unit number `index` (from 0) of `unit` (a target's label, `optimizer step`) is checked."""
    if setting.every <= 1 or index < setting.first:
        return True
    block, offset = divmod(index - setting.first, setting.every)
    return offset == _chosen(setting, unit, block)


def _chosen(setting: Sample, unit: str, block: int) -> int:
    """The offset checked in `block` of `unit`: the same on every rank of a launch, for one seed."""
    seed = setting.seed if setting.seed is not None else _run_seed()
    digest = hashlib.blake2b(f"{seed}\0{unit}\0{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % setting.every


def _run_seed() -> str:
    from kvguard import _ranks

    return _ranks.run_id()


def said(setting: Sample) -> str:
    """`sampled 1 in 100`: how the exit lines name the tier, so a sampled run never reads as a full one."""
    return f"sampled 1 in {setting.every:,}"


STEP = "optimizer step"  # the unit of the process-wide kinds: the interval after each such step


class StepClock:
    """The process's optimizer steps as the sampled tier counts them, and whether the interval
    now (the forward, backward and step after step `index`) is checked.

    It counts the steps of one optimizer, the first to step (a critic's optimizer stepping
    in the same iteration would otherwise cut each iteration in two, and the one checked
    could be the empty stretch between the two steps); when that one is freed, the next
    to step leads. Kinds listen, and are told when the interval they are in changes from
    checked to not or back, right after the step that ends it.
    """

    def __init__(self, setting: Sample) -> None:
        self.setting = setting
        self.index = 0  # the interval now: 0 before the first step
        self.checked = checks(setting, STEP, 0)
        self.intervals_checked = int(self.checked)
        self._lead: Optional[weakref.ref[object]] = None
        self._listeners: list[Callable[[bool], None]] = []
        self._block = (-1, -1)  # (block, the offset checked in it): one hash per block, not per step
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from kvguard._torch import compiled as _compiled

        # Run eagerly inside a `torch.compile`d step too: it detaches and attaches guards.
        self._handle = register_optimizer_step_post_hook(_compiled.outside_dynamo(self._after_step))

    def _after_step(self, optimizer: object, args: object, kwargs: object) -> None:
        lead = self._lead() if self._lead is not None else None
        if lead is None:
            self._lead, lead = weakref.ref(optimizer), optimizer
        if optimizer is not lead:
            return
        self.index += 1
        now = self._checks(self.index)
        self.intervals_checked += now
        if now != self.checked:
            self.checked = now
            for listener in list(self._listeners):
                listener(now)

    def _checks(self, index: int) -> bool:
        """`checks(setting, STEP, index)`, its block's choice hashed once (this runs after every step)."""
        setting = self.setting
        if setting.every <= 1 or index < setting.first:
            return True
        block, offset = divmod(index - setting.first, setting.every)
        if self._block[0] != block:
            self._block = (block, _chosen(setting, STEP, block))
        return offset == self._block[1]

    def listen(self, listener: Callable[[bool], None]) -> Callable[[], None]:
        """Tell `listener(checked)` at each change; returns its removal."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def counts(self) -> tuple[int, int]:
        """(intervals checked, intervals begun): `37 of 3,700 optimizer steps checked`."""
        return self.intervals_checked, self.index + 1

    def close(self) -> None:
        """Stop counting (its hook on torch's optimizers removed); the next `step_clock()` makes a new one."""
        global _clock
        self._handle.remove()
        if _clock is self:
            _clock = None


_clock: Optional[StepClock] = None


def step_clock() -> Optional[StepClock]:
    """The process's step clock under `KVGUARD_SAMPLE` (made on first use; imports torch); None when unsampled."""
    global _clock
    setting = sample()
    if not setting.on:
        return None
    if _clock is None or _clock.setting != setting:
        if _clock is not None:
            _clock.close()
        _clock = StepClock(setting)
    return _clock
