"""The fence: every private or version-sensitive torch API kvguard uses, one concern per module.

- `ops`: op facts, what each op call writes (schemas, and the writes they do not declare);
- `tensors`: a tensor's internals (its TensorImpl's identity, a subclass's or a sparse
  tensor's parts, the same elements or values);
- `dispatch`: the dispatcher's keys and kernels, libraries, this thread's dispatch modes;
- `compiled`: `torch.compile` (code Dynamo must skip or wrote, inductor graphs' mutated inputs);
- `autograd`: autograd's internals (saved-tensor hooks, backward nodes, version counters);
- `pytree`: the pytree registry and a node's keyed children;
- `training`: modules that update their own buffers, `Module._apply`'s functions, DataLoader workers;
- `patches`: every monkeypatch on torch, each a `Patch` (installed with its first listener).

A leaf room: imports no other room of kvguard, and nothing here runs at import but this
docstring; each module imports torch. `tests/test_architecture.py` reads every module outside
this folder for private torch names. Memory geometry (byte spans, exact overlap) needs no
private API and lives with the protected set (`kvguard._protect.geometry`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Names of the one-file fence, still read from this package itself rather than from their
# module (`kvguard/_protect/weights.py` read them; it now imports `tensors` and `training`).
# The compiled hook reads the undeclared-write tables from `ops` itself.
_MOVED = {"PLAIN": "tensors", "same_elements": "tensors",
          "updates_own_buffers": "training", "module_apply_kind": "training"}

if TYPE_CHECKING:
    from kvguard._torch.tensors import PLAIN as PLAIN, same_elements as same_elements
    from kvguard._torch.training import module_apply_kind as module_apply_kind
    from kvguard._torch.training import updates_own_buffers as updates_own_buffers
else:
    def __getattr__(name: str) -> object:
        """A moved name, from its module (imported now: each imports torch)."""
        if name in _MOVED:
            import importlib

            return getattr(importlib.import_module(f"{__name__}.{_MOVED[name]}"), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
