"""`ctx.saved_tensors` under saved-tensor hooks (issue 26): what changes, measured, and the line
kvguard says when it sees the pattern.

Under any saved-tensor hooks (kvguard's, `save_on_cpu`, an identity pair) autograd wraps
what unpack returns in a new tensor: a custom Function's backward gets neither the
Parameter object it saved nor its Python attributes, and an attribute set there does not
reach the Parameter. PyTorch does the same without kvguard; these tests pin it so the docs
stay true, and check that kvguard says so once when a saved Parameter has attributes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

import kvguard
from kvguard._protect import saved as _saved


class _Linear(torch.autograd.Function):
    """Megatron-core's shape: saves the weight, reads and sets a flag on it in backward."""

    seen: ClassVar[list[tuple[str, bool]]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        _Linear.seen.append((type(weight).__name__, hasattr(weight, "grad_added_to_main_grad")))
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        return grad @ weight, grad.t() @ x


def _step(weight: torch.nn.Parameter) -> None:
    _Linear.seen = []
    _Linear.apply(torch.randn(2, 3), weight).sum().backward()


@pytest.mark.parametrize("hooks", ["identity", "save_on_cpu", "kvguard"])
def test_saved_parameter_comes_back_as_a_plain_tensor_without_its_attributes(hooks: str) -> None:
    weight = torch.nn.Parameter(torch.randn(4, 3))
    weight.grad_added_to_main_grad = False
    _step(weight)  # plain PyTorch: the Parameter itself
    assert _Linear.seen == [("Parameter", True)] and weight.grad_added_to_main_grad is True
    weight.grad_added_to_main_grad = False
    context = {"identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
               "save_on_cpu": torch.autograd.graph.save_on_cpu,
               "kvguard": lambda: kvguard.guard_autograd(action="raise")}[hooks]
    with context():
        _step(weight)
    assert _Linear.seen == [("Tensor", False)]  # a new tensor object, no attributes
    assert weight.grad_added_to_main_grad is False  # what backward set never reached it
    assert weight.grad is not None


def test_a_saved_parameter_with_attributes_is_said_once(monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_saved, "_ATTRIBUTES_SAID", False)
    plain = torch.nn.Parameter(torch.randn(4, 3))
    with kvguard.guard_autograd(action="raise"):
        _step(plain)
        torch.sigmoid(torch.randn(3, requires_grad=True)).sum().backward()
    assert "carries Python attributes" not in capfd.readouterr().err  # a Parameter without any
    weight = torch.nn.Parameter(torch.randn(4, 3))
    weight.main_grad = torch.zeros(4, 3)
    weight.grad_added_to_main_grad = False
    weight._private = 1
    with kvguard.guard_autograd(action="raise"):
        _step(weight)
        _step(weight)
    err = capfd.readouterr().err
    assert err.count("kvguard: autograd: a Parameter saved for backward carries Python attributes "
                     "(grad_added_to_main_grad, main_grad); ") == 1, err
    assert "ctx.saved_tensors under saved-tensor hooks" in err


class _SavesItsOutput(torch.autograd.Function):
    """Makes nodes inside its forward (grad enabled there), then saves its output: its node is
    not the newest when the output is saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            (x.detach().requires_grad_() * 2).sum()
        out = x * 3
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (out,) = ctx.saved_tensors
        return grad * 3


def _in_place_on_a_view(w: torch.Tensor) -> torch.Tensor:
    base = w * 1
    view = base[:2]
    view.sigmoid_()  # saves its result, a view whose grad_fn autograd remakes after the write
    return base


@pytest.mark.parametrize("make", [
    lambda w: torch.sigmoid(w * 1),  # saves its output
    lambda w: (w * 1).exp(),
    lambda w: (w * 1).sin(),  # saves its input, made by an earlier node
    lambda w: w.sin(),  # saves a leaf
    _in_place_on_a_view,
    _SavesItsOutput.apply,
], ids=["sigmoid", "exp", "sin-of-intermediate", "sin-of-leaf", "in-place-on-view", "custom-function"])
def test_what_the_c_pack_keeps_closes_no_cycle(make: Any) -> None:
    """The C pack keeps a saved input itself (as autograd does without hooks) and an alias of a
    saved output (its grad_fn is the node saving it: held, it would close a cycle through C++
    that no collector frees); a graph nobody runs backward on dies with its last tensor."""
    import weakref

    with kvguard.guard_autograd(action="raise"):
        w = torch.randn(4, requires_grad=True)
        out = make(w)
        gone = weakref.ref(out)
        del out
        assert gone() is None
