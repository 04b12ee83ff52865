"""`torch.compile` as kvguard meets it: code Dynamo must leave alone, code Dynamo wrote, and
what an inductor-compiled graph says of the inputs it writes.

kvguard's wrappers, kernels and callbacks also run inside compiled functions, where Dynamo
would trace them; `outside_dynamo` keeps them eager. An inductor graph writes its inputs in
its own kernels, where no op is dispatched: its artifact names them (`mutated_inputs`) and
its post-grad graph's comments say at which line (`compiled_graph_text`). The patch that
asks about each call lives in `patches`.
"""

from __future__ import annotations

import types
from typing import Callable, Collection, Protocol, Sequence, TypeVar, cast

import torch

F = TypeVar("F", bound=Callable[..., object])


class CompiledGraph(Protocol):
    """An inductor-compiled graph (`CompiledFxGraph`), as far as kvguard reads it."""

    @property
    def mutated_input_idxs(self) -> Collection[int]: ...


def outside_dynamo(fn: F, callees: bool = False) -> F:
    """`fn`, never traced by Dynamo, and run eagerly, with what it calls, from `torch.compile`d code.

    `callees=True`: only `fn`'s own frame is skipped; what it calls is compiled as if called
    from the compiled code directly (a wrapper around the user's `opt.step` stays out of its
    graphs, while the step itself is compiled as without kvguard).

    kvguard's wrappers, kernels and callbacks run inside compiled functions too, where
    Dynamo would trace them (and crash on weak references, frames, dispatch modes). The
    code object is marked for the frame evaluator to skip, recursively: no cost per call
    and no frame of torch's in between. `_torchdynamo_disable` makes Dynamo's tracer break
    the graph at a call of `fn` instead of inlining it. Without the first (another torch),
    the `torch._dynamo.disable` wrapper does both, at ~45 µs a call.
    """
    try:
        from torch._C._dynamo import eval_frame

        skip = eval_frame._FrameAction.SKIP
        inside = eval_frame._FrameAction.DEFAULT if callees else skip
        code: types.CodeType = getattr(fn, "__code__")
        eval_frame.set_code_exec_strategy(code, eval_frame._FrameExecStrategy(skip, inside))
    except Exception:  # noqa: BLE001 - another torch: the slow wrapper
        return cast(F, getattr(torch, "_disable_dynamo")(fn, recursive=not callees))
    try:
        setattr(fn, "_torchdynamo_disable", True)
        setattr(fn, "_torchdynamo_disable_msg", "kvguard runs eagerly")
    except (AttributeError, TypeError):  # noqa: BLE001 - an object without attributes: marked code only
        pass
    return fn


def dynamo_generated(code: types.CodeType) -> bool:
    """Whether `code` is bytecode Dynamo wrote (a compiled function's frame, a resume function):
    its line numbers say little of where the user's code is."""
    try:
        from torch._dynamo import convert_frame
    except Exception:  # noqa: BLE001 - a torch without Dynamo
        return False
    return code in convert_frame.output_codes


def mutated_inputs(graph: CompiledGraph, inputs: Sequence[object]) -> tuple[list[int], list[torch.Tensor]]:
    """The positions of the inputs the compiled graph writes, and those inputs (tensors, as
    inductor's artifact lists only tensors as mutated)."""
    positions = [i for i in graph.mutated_input_idxs if i < len(inputs)]
    return positions, cast(list[torch.Tensor], [inputs[i] for i in positions])


def compiled_graph_text(graph: object) -> str:
    """The post-grad FX graph the artifact was generated from, as Python source with each
    node's `# File: ..., code: ...` comment ("" where this torch keeps none). On an FX graph
    cache hit it is the text of the first compile of an equal graph: check its lines."""
    return str(getattr(graph, "inductor_post_grad_graph_str", "") or "")
