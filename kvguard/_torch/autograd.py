"""Autograd's internals as the saved-tensor guard reads them (`kvguard._protect.saved`): the
saved-tensor hooks active now, the backward node and pass running now, what a node saved,
view bases and version counters.

Reads only; the two patches autograd's saved-tensor hooks need (composing with other hooks,
stepping aside for `torch.func` transforms) are in `patches`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.autograd.graph import Node

PackHook = Callable[[torch.Tensor], object]  # what a `saved_tensors_hooks` pack hook is


def top_saved_tensors_pack() -> Optional[PackHook]:
    """The pack hook of the innermost `saved_tensors_hooks` active on this thread (None: none)."""
    hooks: Optional[tuple[PackHook, object]] = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks[0] if hooks is not None else None


def saved_tensors_hooks_disabled() -> bool:
    """Whether saved-tensor hooks are refused here (inside `torch.func.grad`, `vjp`, `jacrev`, `hessian`)."""
    return not torch._C._autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]


def inlineable_hook(hook: object) -> bool:
    """Whether `torch.compile` inlines this saved-tensor hook into its graphs (an fx GraphModule)."""
    return isinstance(hook, torch.fx.GraphModule)


def view_base(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor `tensor` is a view of (None: not a view)."""
    try:
        return tensor._base if tensor._is_view() else None
    except Exception:  # noqa: BLE001 - a subclass without view tracking
        return None


def current_graph_task_id() -> int:
    """The backward pass (graph task) running on this thread; -1 outside backward."""
    return int(torch._C._current_graph_task_id())


def allowing_mutation_on_saved_tensors() -> bool:
    """Whether `torch.autograd.graph.allow_mutation_on_saved_tensors()` is active: writes to saved
    tensors are legal there (autograd keeps a copy)."""
    import torch.autograd.graph as graph

    return bool(getattr(graph, "_allow_mutation_on_saved_tensors_enabled", False))


def current_autograd_node() -> Optional[Node]:
    """The backward node running now on this thread (None outside backward)."""
    node: Optional[Node] = torch._C._current_autograd_node()
    return node


def node_serial(node: Node) -> Optional[int]:
    """A backward node's sequence number: which node it is, while it lives."""
    try:
        return int(node._sequence_nr())
    except Exception:  # noqa: BLE001
        return None


def saved_slots(node: Node) -> list[tuple[str, Any]]:
    """(slot, what was packed) for each tensor `node` saved for backward, read without unpacking.

    A `SavedTensor`'s `.data` is the pack hook's result when a hook packed it: reading it runs
    no unpack hook (no checkpoint recomputation, no copy back from the CPU). What was packed is
    whatever the pack hook returned (typed `Any`: the caller knows its own hooks' results).
    """
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(n for n in dir(type(node)) if n.startswith("_raw_saved_"))
    found: list[tuple[str, Any]] = []
    for name in names:
        try:
            raw = getattr(node, name)
        except Exception:  # noqa: BLE001 - freed by a backward already run
            continue
        slot = "saved_tensors" if name == "_raw_saved_tensors" and isinstance(
            node, torch.autograd.function.BackwardCFunction) else name[len("_raw_saved_"):]
        for i, saved in enumerate(raw) if isinstance(raw, (list, tuple)) else ((None, raw),):
            try:
                data = saved.data
            except Exception:  # noqa: BLE001
                continue
            found.append((slot if i is None else f"{slot}[{i}]", data))
    return found


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def next_nodes(node: Node) -> list[Node]:
    """The nodes `node` feeds gradients to (its inputs' grad_fns and accumulators)."""
    try:
        return [n for n, _ in node.next_functions if n is not None]
    except Exception:  # noqa: BLE001
        return []


def shares_version_counter(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a write to `a` bumps the version counter `b` reads (views of one base share one).

    Asked by bumping `a`'s counter and setting it back: the counters end as they were.
    """
    try:
        if a.is_inference() or b.is_inference():
            return False
        before_a, before_b = a._version, b._version
        torch.autograd.graph.increment_version(a)
        try:
            return bool(b._version != before_b)
        finally:
            torch._C._autograd._unsafe_set_version_counter((a,), (before_a,))
    except Exception:  # noqa: BLE001 - a subclass without a counter
        return False
