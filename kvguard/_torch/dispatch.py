"""The dispatcher as kvguard's write hooks meet it: the keys they sit on, the kernels they call
back, the libraries they register, this thread's dispatch-mode stack, and the C++ ABI the
compiled hook is built against.

The compiled hook (`csrc/write_hook.cpp`) asks the dispatcher the same questions in C++; the
`kernels` engine and the `mode` engine ask them here.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # the mode engine's base

if TYPE_CHECKING:
    from torch._C import _SafeKernelFunction
    from torch._ops import OpOverload

ExcInfo = tuple[Optional[type[BaseException]], Optional[BaseException], Optional[TracebackType]]

HOOK_KEY = "ADInplaceOrView"
BELOW_HOOK = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.ADInplaceOrView)
# The key of the inference-mode kernels (`csrc/write_hook.cpp`, kInferenceKey): torch's
# Python enum does not name it; it sits just above FuncTorchGradWrapper.
INFERENCE_KEY_NAME = "DeferredInit"
INFERENCE_KEY = torch._C.DispatchKey(torch._C.DispatchKey.FuncTorchGradWrapper.value + 1)
BELOW_INFERENCE = torch._C._dispatch_keyset_full_after(INFERENCE_KEY)


def all_op_names() -> list[str]:
    """Every op registered with the dispatcher now, `ns::name.overload`."""
    return list(torch._C._dispatch_get_all_op_names())


def thread_includes(key: torch._C.DispatchKey) -> bool:
    """Whether this thread's dispatch key set has `key` switched on."""
    return bool(torch._C._dispatch_tls_is_dispatch_key_included(key))


def set_thread_includes(key: torch._C.DispatchKey, on: bool) -> None:
    torch._C._dispatch_tls_set_dispatch_key_included(key, on)


def has_fallback(key: torch._C.DispatchKey) -> bool:
    """Whether someone registered a fallback kernel for every op on `key`."""
    return bool(torch._C._dispatch_has_backend_fallback(key))


def hook_kernel(func: OpOverload[..., object], name: str) -> Optional[_SafeKernelFunction]:
    """The op's own kernel on the hook key (to call it back), or None when it has none."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, HOOK_KEY):
        return None
    return torch.library.get_kernel(func, HOOK_KEY)


def python_hook_kernel(name: str) -> bool:
    """Whether the op's own kernel on the hook key is Python (a `torch.library.custom_op`)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, HOOK_KEY):
        return False
    return ".py:" in str(torch._C._dispatch_get_computed_kernel_for_dispatch_key(name, HOOK_KEY))


def destroy_library(library: torch.library.Library) -> None:
    """Remove every kernel a `torch.library.Library` registered."""
    library._destroy()  # type: ignore[no-untyped-call]


def current_dispatch_modes() -> list[TorchDispatchMode]:
    """This thread's dispatch modes, outermost first."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def innermost_dispatch_mode() -> Optional[TorchDispatchMode]:
    """The dispatch mode that ops on this thread reach first, or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


# What `TorchDispatchMode.__enter__` saves and `__exit__` restores, one entry per entry.
_SAVED_MODE_FLAGS = ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
                     "old_without_ignore_compile_internals_dispatch_mode_flags")


def exit_dispatch_mode(mode: TorchDispatchMode, exc_info: ExcInfo) -> None:
    """Leave `mode`, even when modes entered after it are still active.

    A guard held by a generator that is dropped while another guard is active exits
    while it is not innermost. Popping would remove someone else's mode, so the modes
    above it are lifted off, `mode` is removed, and they are put back; the flags `mode`
    saved on entry pass to the mode entered right after it, which now restores them.
    A mode on another thread's stack cannot be reached: the caller makes it inert.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if innermost_dispatch_mode() is mode:
        mode.__exit__(*exc_info)  # type: ignore[no-untyped-call]
        return
    if not any(m is mode for m in _get_current_dispatch_mode_stack()):
        return
    above: list[TorchDispatchMode] = []
    while (top := torch._C._pop_torch_dispatch_stack(None)) is not mode:
        above.append(top)
    successor = above[-1] if above else None
    for name in _SAVED_MODE_FLAGS:
        ours, theirs = getattr(mode, name, None), getattr(successor, name, None)
        if ours:
            saved = ours.pop()
            if theirs:
                theirs[-1] = saved
    for top in reversed(above):
        torch._C._push_on_torch_dispatch_stack(top)


def cxx11_abi() -> int:
    """The `_GLIBCXX_USE_CXX11_ABI` torch was built with, for compiling against it."""
    return int(torch._C._GLIBCXX_USE_CXX11_ABI)
