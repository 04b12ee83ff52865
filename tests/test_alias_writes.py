"""Writes through elements that share memory (an `expand`ed tensor): `kind="alias"`, even where allowed.

NVIDIA-NeMo/RL #2787: `advantages = per_sample.unsqueeze(-1).expand(mask.shape)`, then a
one-token span write `advantages[i, s:e] = v` changed the whole row (and the per-sample
tensor). PyTorch refuses such a write over more than one element, but not over one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvguard
from setitem_ops import SHARED_FILL_REFUSED, SLICE_FILL

SHARED = ("a write naming 1 element changes 6: this tensor's elements share memory (a dimension of stride 0, "
          "from expand), so a write to one changes every element sharing it")


def line_of(marker: str) -> int:
    return next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if marker in text and "line_of(" not in text)


def batch() -> dict[str, torch.Tensor]:
    per_sample = torch.tensor([[1.0], [10.0]])
    return {"advantages": per_sample.expand(2, 6), "per_sample": per_sample}


def test_a_one_element_write_through_an_expanded_tensor_is_reported_where_its_path_is_allowed() -> None:
    data = batch()
    with kvguard.guard(data, name="train_data", action="record", allow=["train_data['advantages']"]) as g:
        data["advantages"][0, 2:3] = -5.0  # SPAN
    alias = [e for e in g.report.events if e.path == "train_data['advantages']"]
    assert [(e.kind, e.op, e.lineno, e.blocked) for e in alias] == [
        ("alias", SLICE_FILL, line_of("# SPAN"), False)]
    assert alias[0].diff.startswith(SHARED + "; 6/12 elements changed")
    assert alias[0].headline().startswith(
        "train_data['advantages'] (the same memory as train_data['per_sample']) was modified in place through "
        f"elements that share memory by {SLICE_FILL}")
    # the per-sample tensor is another entry: a plain write, its path not allowed
    assert [(e.path, e.kind) for e in g.report.events if e.path != "train_data['advantages']"] == [
        ("train_data['per_sample']", "write")]


def test_raise_stops_it_and_says_how_many_elements_it_would_change() -> None:
    data = batch()
    with pytest.raises(kvguard.MutationError) as caught:
        with kvguard.guard(data, name="train_data", action="raise", allow=["train_data['advantages']"]):
            data["advantages"][1, 0:1] = 3.0
    event = caught.value.event
    assert (event.path, event.kind, event.blocked, event.diff) == ("train_data['advantages']", "alias", True, SHARED)
    assert f"  shared   {SHARED}\n" in str(caught.value) + "\n"
    assert torch.equal(data["per_sample"], torch.tensor([[1.0], [10.0]]))  # stopped: intact


def test_a_kvguard_allow_block_still_allows_it() -> None:
    data = batch()
    with kvguard.guard(data, name="train_data", action="raise") as g:
        with kvguard.allow("this row is meant to change as one"):
            data["advantages"][0, 0:1] = 2.0
    assert not g.report.events and g.report.allowed == {"kvguard.allow('this row is meant to change as one')": 2}


def test_writes_that_change_only_what_they_name_stay_plain_writes() -> None:
    per_sample = torch.tensor([1.0, 10.0])
    cloned = per_sample.unsqueeze(-1).expand(2, 6).clone()  # the fix: one element per value
    data = {"per_sample": per_sample, "advantages": cloned}
    with kvguard.guard(data, name="d", action="record", allow=["d['advantages']"]) as g:
        cloned[0, 2:4] = -5.0  # allowed, and only two elements change
        per_sample.unsqueeze(-1).expand(2, 6)[0, 1:2] = 7.0  # one element of per_sample, named as one
    assert [(e.path, e.kind) for e in g.report.events] == [("d['per_sample']", "write")]
    assert g.report.allowed == {"allow=d['advantages']": 1}


def test_a_wider_write_that_torch_refuses_is_stopped_by_the_guard_first_or_left_to_torch() -> None:
    data = batch()
    with pytest.raises(kvguard.MutationError):
        with kvguard.guard(data, name="train_data", action="raise", allow=["train_data['advantages']"]):
            data["advantages"][0, 1:4] = -5.0
    data = batch()
    with kvguard.guard(data, name="train_data", action="record", allow=["train_data['advantages']"]) as g:
        if SHARED_FILL_REFUSED:  # torch <= 2.14: fill_.Tensor refuses it
            with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
                data["advantages"][0, 1:4] = -5.0
        else:  # torch 2.15's fill_.Scalar lets it land: the guard is all that reports it
            data["advantages"][0, 1:4] = -5.0  # WIDE
    alias = [e for e in g.report.events if e.kind == "alias"]
    if SHARED_FILL_REFUSED:
        assert torch.equal(data["per_sample"], torch.tensor([[1.0], [10.0]]))
        assert not alias  # nothing landed: nothing to report
    else:
        assert torch.equal(data["per_sample"], torch.tensor([[-5.0], [10.0]]))
        assert [(e.path, e.op, e.lineno) for e in alias] == [("train_data['advantages']", SLICE_FILL, line_of("# WIDE"))]
        assert alias[0].diff.startswith("a write naming 3 elements changes 6: this tensor's elements share memory")


def test_a_saved_expanded_tensor_written_through_its_base() -> None:
    base = torch.randn(3, 1)
    w = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(kvguard.MutationError) as caught:
        with kvguard.guard_autograd(action="raise"):
            expanded = base.expand(3, 4)
            out = expanded * w  # saves the expanded view
            base[0].add_(1.0)
            out.sum().backward()
    assert caught.value.event.kind == "alias"
    assert "a write naming 1 element changes 4" in caught.value.event.diff
