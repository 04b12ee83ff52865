"""The moment a value is stored into a guarded dict, where the interpreter can tell it.

CPython 3.12 and later call a dict watcher just before each store into a dict it watches
(`kvguard._native.stores`). A guard watches the dicts of its guarded object (instance
`__dict__`s too), so a tensor placed into one is digested as it is placed: a change made
between the placement and the next write op kvguard sees, by any writer (numpy, a
streamer's C code refilling a host buffer the tensor views, another process), is then
found, at that op or at the next boundary. Elsewhere (Python 3.11, or without the
extension) a placement is first read at the next write op, as before: `AVAILABLE` says
which. Lists, slots and deques have no watchers: their stores are read at the next op.

One process-wide watcher: listeners register per dict, and a dict is watched while one
listens.
"""

from __future__ import annotations

from typing import Callable

Listener = Callable[[object], None]  # told the value stored (a tensor, a container, any object)

try:
    from kvguard._native import stores as _stores
except ImportError:  # pragma: no cover - built at install where a C compiler is found
    _stores = None  # type: ignore[assignment]

_listeners: dict[int, tuple[dict[object, object], list[Listener]]] = {}  # id(d) -> (d, who listens)


def _on_store(d: dict[object, object], key: object, value: object) -> None:
    """The watcher's callback: tell each listener of `d`; never raise into the user's store."""
    listening = _listeners.get(id(d))
    if listening is None or listening[0] is not d:
        return
    for listener in list(listening[1]):
        try:
            listener(value)
        except Exception:  # noqa: BLE001 - a failed look-ahead costs only the early digest
            pass


AVAILABLE: bool = bool(_stores is not None and _stores.start(_on_store))


def listen(d: dict[object, object], listener: Listener) -> None:
    """Call `listener(value)` before each store into `d` (no-op where `AVAILABLE` is false)."""
    if not AVAILABLE:
        return
    listening = _listeners.get(id(d))
    if listening is None or listening[0] is not d:
        _stores.watch(d)
        _listeners[id(d)] = (d, [listener])
    elif listener not in listening[1]:
        listening[1].append(listener)


def unlisten(d: dict[object, object], listener: Listener) -> None:
    """Stop calling `listener` for `d`; the dict is unwatched once nobody listens."""
    listening = _listeners.get(id(d))
    if listening is None or listening[0] is not d:
        return
    if listener in listening[1]:
        listening[1].remove(listener)
    if not listening[1]:
        del _listeners[id(d)]
        _stores.unwatch(d)
