"""gradcheck perturbing an input whose `expand` autograd saved (PyTorch's test_functional.py
create_graph tests: a 0-dim grad output expanded by sum's backward, then saved).

gradcheck is a well-known intended writer (`kvguard._intended`): its perturbation is
allowed with no setting. A write to one element that changes many elements of a saved
expanded view is kind "alias", which path patterns and a user's scopes never cover (they
name the elements meant); an intended writer covers it, since the function restores every
element it perturbs before backward reads it. The same write elsewhere is still stopped.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import kvguard

W = torch.randn(4, 4, dtype=torch.double)


def test_gradcheck_and_gradgradcheck_through_a_saved_expand_pass_under_raise() -> None:
    x = torch.randn((), dtype=torch.double, requires_grad=True)
    with kvguard.guard_autograd(action="raise") as g:
        assert gradcheck(lambda x: x.expand(4, 4).pow(2) * W, (x,))  # pow saves the expanded x
        assert gradgradcheck(lambda x: (x.expand(4, 4).pow(2) * W).exp(), (x,))
    assert g.report.events == []
    assert set(g.report.allowed) == {"intended writer torch.autograd.gradcheck perturbation"}


def test_the_same_write_outside_gradcheck_is_still_stopped() -> None:
    x = torch.randn((), dtype=torch.double, requires_grad=True)
    with kvguard.guard_autograd(action="raise"):
        y = x.detach().requires_grad_()
        z = y.expand(4, 4).pow(2)
        with pytest.raises(kvguard.MutationError, match="through elements that share memory"):
            y.data.copy_(torch.tensor(2.0, dtype=torch.double))
        z.sum().backward()


def test_a_users_scope_still_does_not_cover_shared_elements() -> None:
    x = torch.randn((), dtype=torch.double, requires_grad=True)

    def perturb(t: torch.Tensor) -> None:
        t.data.add_(1.0)

    with kvguard.guard_autograd(action="raise", allow=[f"{__name__}:perturb"]):
        y = x.detach().requires_grad_()
        z = y.expand(4, 4).pow(2)
        with pytest.raises(kvguard.MutationError, match="through elements that share memory"):
            perturb(y)
        z.sum().backward()
