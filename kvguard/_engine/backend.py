"""What a write-hook backend does: the compiled hook and the Python kernels are both one.

A backend is a module. `kvguard._native.write_hook` is the compiled one (built at first
use, typed by its `.pyi`); `kvguard._engine.kernels` is its Python twin. `HookEngine`
drives a backend through these functions and nothing else, and `choice` hands it one of
the two; mypy checks that each module has them, with these signatures (see `choice`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

# Called on a possible hit with the op's name and every tensor it writes (and, as a third
# argument only when there are any, the tensors it only reads that share a storage with
# those); may return what to call once the write is done (`after()`, or `after(True)` if
# the op raised).
Callback = Callable[..., Optional[Callable[..., object]]]


class Backend(Protocol):
    def install(self) -> int:
        """Hook every op overload registered now that writes an argument; how many (idempotent)."""

    def uninstall(self) -> None:
        """Remove the hooks: the original kernels are back."""

    def installed(self) -> bool: ...

    def hook_new(self) -> int:
        """Hook the writing ops defined since the last call (a later `custom_op`); how many."""

    def hooked_ops(self) -> list[str]:
        """Names of the hooked overloads, `ns::name.overload`."""

    def watch_inference(self, on: bool) -> bool:
        """This thread guards an inference tensor (on), or one guard fewer does (off)."""

    def set_enabled(self, on: bool) -> None:
        """The switch: off, a hooked op only calls its original."""

    def enabled(self) -> bool: ...

    def set_send_all(self, on: bool) -> None:
        """Call the callback for every outermost write (memory the intervals cannot show)."""

    def set_intervals(self, intervals: Sequence[tuple[int, int]]) -> None:
        """The protected byte ranges, [start, stop), sorted and disjoint."""

    def set_identities(self, identities: Sequence[int]) -> None:
        """Protected tensors by identity (`tensor._cdata`), wherever their memory is."""

    def add_protected(self, intervals: Sequence[tuple[int, int]], identities: Sequence[int],
                      replace: bool = False) -> None:
        """Protect more (any order, any overlap), or publish these instead (`replace`)."""

    def set_callback(self, callback: Optional[Callback]) -> None: ...

    def set_watch(self, watch: Optional[Callable[[], None]], snapshots: Any = None) -> None:
        """Called before every outermost write while enabled (with `snapshots`: only when one changed)."""

    def writes(self) -> int:
        """How many outermost writing ops ran while enabled."""

    def candidates(self, tensors: Sequence[Any]) -> list[int]:
        """The positions of the tensors a write into which would reach the callback now (the
        hook's own test, for writes no op dispatches: a compiled graph's kernels)."""
