"""Which engine finds a guard's writes: `compiled`, `kernels` or `mode`.

- `compiled`: the write hook in C++ (`write_hook`, built for the installed torch on
  first use, see `kvguard._native.build`): about unguarded speed.
- `kernels`: the same hook as Python kernels (`kernels`): no compiler needed, every
  writing op becomes a Python call.
- `mode`: a `TorchDispatchMode` (`mode`): every op becomes a Python call; the only
  engine on torch < 2.9 (no computed-kernel API), and the one that sees inference-mode
  writes from threads other than the guard's (the write hooks see its own thread's).

The first available one is used; `KVGUARD_ENGINE=compiled|kernels|mode` asks for one.
An engine that cannot be had is one line on stderr, then the next one: never a crash.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union, cast

import torch

from kvguard import _config
from kvguard._engine import graphs, kernels
from kvguard._engine.backend import Backend
from kvguard._engine.hooks import HookAttachment, HookEngine
from kvguard._engine.judge import WriteJudge
from kvguard._engine.mode import ModeAttachment, thread_judges
from kvguard._native import build as _build
from kvguard._text import say

if TYPE_CHECKING:  # mypy checks here that both backends are one, the compiled one by its .pyi
    from kvguard._native import write_hook

    _BACKENDS: tuple[Backend, Backend] = (write_hook, kernels)

ENGINES = ("compiled", "kernels", "mode")
_hook_engines: dict[str, HookEngine] = {}
_unavailable: dict[str, str] = {}  # engine -> why it cannot be had in this process
_said: set[str] = set()
_BUSY = " is in use by an active guard"


def requested() -> Optional[str]:
    """The engine `KVGUARD_ENGINE` asks for, or None (auto); a bad value is one line, then auto."""
    raw = _config.read("KVGUARD_ENGINE").lower()
    if raw in ("", "auto"):
        return None
    if raw in ENGINES:
        return raw
    _say_once(f"bad:{raw}", f"kvguard: KVGUARD_ENGINE={raw!r} is not one of auto, {', '.join(ENGINES)}; "
                            "choosing automatically")
    return None


def choose() -> str:
    """The engine the next guard uses: the requested one if it can be had, else the first that can.

    While a guard uses a write hook, later guards use it too (two hooks cannot be stacked).
    """
    wanted = requested()
    busy = next((name for name, hook in _hook_engines.items() if hook.judges), None)
    if busy is not None and wanted != "mode":
        return busy
    order = ENGINES[ENGINES.index(wanted):] if wanted is not None else ENGINES
    for name in order:
        why = why_not(name)
        if why is None:
            return name
        if name == wanted:
            _say_once(f"fallback:{name}", f"kvguard: KVGUARD_ENGINE={name} is not available ({why}); "
                                          "using the next engine")
        elif name == "compiled" and not why.endswith(_BUSY):  # not merely busy: slower from here on
            _say_once("fallback:auto", f"kvguard: the compiled engine is not available ({why}); using a "
                                       "slower one (KVGUARD_ENGINE=mode or kernels silences this)")
    return "mode"


def why_not(name: str) -> Optional[str]:
    """Why `name` cannot be used in this process, or None when it can (installs it).

    One write hook at a time: kernels stacked on kernels would call each other. Another
    hook engine with no guard attached is uninstalled first; one in use makes this one
    unavailable until its guards exit.
    """
    if name == "mode":
        return None
    if name in _unavailable:
        return _unavailable[name]
    for other, hook in list(_hook_engines.items()):
        if other != name:
            if hook.judges:
                return f"the {other} engine{_BUSY}"
            hook.uninstall()
            del _hook_engines[other]
    if name not in _hook_engines:
        try:
            backend = _backend(name)
            if isinstance(backend, str):
                _unavailable[name] = backend
                return backend
            _hook_engines[name] = HookEngine(name, backend)
        except Exception as exc:  # noqa: BLE001 - an engine that fails to install is not used
            _unavailable[name] = f"{type(exc).__name__}: {exc}"
            return _unavailable[name]
    return None


def install_only(name: Optional[str]) -> None:
    """Leave exactly the write hook `name` installed (None: none), for a fair comparison.

    For benchmarks and tests; no guard may be attached to the others.
    """
    for other, hook in list(_hook_engines.items()):
        if other != name:
            hook.uninstall()
            del _hook_engines[other]
    if name not in (None, "mode"):
        why = why_not(name)
        if why is not None:
            raise RuntimeError(f"the {name} engine is not available: {why}")


def _backend(name: str) -> Union[Backend, str]:
    """The backend module for a hook engine, or a string saying why there is none."""
    if not hasattr(torch.library, "get_kernel"):
        return f"torch {torch.__version__} lacks the computed-kernel API (torch >= 2.9 has it)"
    if name == "kernels":
        return kernels
    module = _build.load()  # kvguard._native.write_hook, loaded from the build cache
    return cast(Backend, module) if module is not None else _build.reason()


def attach(judge: WriteJudge) -> Union[HookAttachment, ModeAttachment]:
    """Start reporting writes to `judge`; returns the attachment (`.engine`, `.ops`, `.detach(exc_info)`)."""
    graphs.listen(judges_of)  # every engine: compiled graphs write where none of them looks
    name = choose()
    if name != "mode":
        try:
            return _hook_engines[name].attach(judge)
        except Exception as exc:  # noqa: BLE001
            _unavailable[name] = f"{type(exc).__name__}: {exc}"
            _say_once(f"failed:{name}", f"kvguard: the {name} engine failed ({_unavailable[name]}); "
                                        "using the dispatch mode")
    return ModeAttachment(judge)


def judges_of(tensors: Sequence[torch.Tensor]) -> dict[int, list[WriteJudge]]:
    """Position -> the active guards' judges a write into `tensors[position]` is shown to, in
    the order a write reaches them: the write hook's (innermost first, and only where the hook
    itself would call them), then this thread's dispatch modes'. Positions shown to none are left out."""
    modes = thread_judges()
    found: dict[int, list[WriteJudge]] = {i: list(modes) for i in range(len(tensors))} if modes else {}
    for hook in list(_hook_engines.values()):
        judges = list(reversed(list(hook.judges)))
        if judges:
            hook.look()  # what was placed since the last write is protected first, as the hook does
            for i in hook.backend.candidates(tensors):
                found[i] = judges + found.get(i, [])
    return found


def _say_once(key: str, line: str) -> None:
    if key not in _said:
        _said.add(key)
        say(line)
