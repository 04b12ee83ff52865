"""Saved wrapper-subclass tensors have no memory of their own (issue 26).

A wrapper subclass (`torch.Tensor._make_wrapper_subclass`: PyTorch's LoggingTensor,
FakeTensor-like test tensors) has a storage with a null base, and its `data_ptr()` is
its storage offset times its item size alone. kvguard read that as an address, so a
saved view with an offset and any fresh wrapper tensor written at an overlapping offset
"shared memory": `torch.autograd.functional.hessian(..., vectorize=True)` on LoggingTensors
had the `fill_` of its fresh basis (`chunk.diagonal(-k).fill_(1)`) reported as a write to
`<saved by a node not found>` whenever such a saved view was still alive (PyTorch's
test_functional.py: test_hessian_err_check_vectorize_True_logging_tensor after the
create_graph tests). Such tensors have no span now; backward's version check still
covers a write to the saved tensor itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.functional as autogradF
from torch.testing._internal.logging_tensor import LoggingTensor

import kvguard
from kvguard._protect import geometry as _geometry


def _logging(*shape: int) -> torch.Tensor:
    return LoggingTensor(torch.randn(*shape, dtype=torch.double), requires_grad=True)


def test_a_wrapper_subclass_view_has_no_memory_span() -> None:
    x = _logging(4, 4)
    view = x[2:]
    assert view.storage_offset() == 8 and view.data_ptr() == 64  # the offset alone, no address
    assert _geometry.spans(view) == [] and _geometry.spans(x) == []
    plain = torch.randn(4, 4)[2:]
    assert _geometry.spans(plain) and _geometry.spans(plain)[0].start == plain.data_ptr()  # plain views unchanged


def test_fresh_wrapper_tensor_written_at_a_saved_views_offset_is_not_reported() -> None:
    x = _logging(4, 4)
    with kvguard.guard_autograd(action="raise") as g:
        y = (x[2:] ** 2).sum()  # pow saves its input: a LoggingTensor view at offset 8 (data_ptr 64)
        basis = x.new_zeros(16, 4)
        basis.diagonal(-2).fill_(1)  # a fresh tensor; its diagonal view's data_ptr is 64 too
        y.backward()
    assert g.report.events == []
    assert basis.diagonal(-2).eq(1).all()


def test_a_write_to_the_saved_wrapper_tensor_itself_still_fails_backward() -> None:
    """Autograd's check stays on for them: the detached alias kvguard keeps shares the saved
    wrapper's version counter. (The write is not reported at its line: a tensor with no
    memory is matched by identity, and the object written is not the alias kept.)"""
    x = _logging(4, 4)
    with kvguard.guard_autograd(action="record"):
        v = x[2:].clone()
        y = (v ** 2).sum()  # pow saves v itself
        v.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_vectorized_hessian_on_logging_tensors_with_a_saved_view_alive() -> None:
    """PyTorch's test_hessian_err_check (vectorize, logging_tensor): the basis of two inputs
    of 4 and 5 elements is a (9, 4) and a (9, 5) chunk, and the second's `diagonal(-4)`
    (offset 20, `data_ptr()` 160) met a saved view left alive by an earlier test."""
    x = _logging(8, 8)

    def foo(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (3 * b.narrow(0, 0, 3) * a.narrow(0, 0, 3)).sum()

    inp = (LoggingTensor(torch.rand(4, dtype=torch.double)), LoggingTensor(torch.rand(5, dtype=torch.double)))
    expected = autogradF.hessian(foo, inp, vectorize=False)
    with kvguard.guard_autograd(action="raise") as g:
        kept = (x[2:] ** 2).sum()  # a saved LoggingTensor view at offset 16: "bytes" 128 to 512
        hess = autogradF.hessian(foo, inp, vectorize=True)
        jac = autogradF.jacobian(foo, inp, vectorize=True)
        kept.backward()
    assert g.report.events == []
    assert all(torch.equal(h, e) for row, erow in zip(hess, expected) for h, e in zip(row, erow))
    assert len(jac) == 2
