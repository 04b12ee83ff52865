"""Pausing the garbage collector while kvguard allocates many small objects at once. Stdlib only."""

from __future__ import annotations

import gc
from typing import Any


class CollectorPaused:
    """No garbage collection while a look allocates its entries.

    A look over 15,000 tensors allocates ~100,000 objects, enough to trigger a full
    collection over every object of the process (torch alone has ~500,000, ~0.2 s),
    which tripled the cost of entering a guard. They are collected later as usual.
    """

    __slots__ = ("was_on",)

    def __enter__(self) -> None:
        self.was_on = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self.was_on:
            gc.enable()


collector_paused = CollectorPaused
