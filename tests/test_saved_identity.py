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
