"""What `guard_autograd` costs per saved tensor, by what runs: no Python for a plain pack, an
unpack, or a write to memory a freed saved tensor left (issue 27).

With the compiled write hook, kvguard's saved-tensor hooks are C (`SavedHooks`): a pack keeps
the tensor and tells the hook its memory as a saved row, which goes the moment autograd lets
the tensor go. These tests count the Python calls that used to run per saved tensor and per
gradient write, and check that what the C path skips is still seen (a write to a live saved
tensor is stopped at its line, with the saving node and line named).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import kvguard
from kvguard._protect import saved as _saved

pytestmark = pytest.mark.parametrize("engine", ["compiled"], indirect=True)


def _line(marker: str) -> int:
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()  # type: ignore[arg-type]
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)


def _count(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count calls of SavedSet.`name` (patched before a guard binds it)."""
    calls = [0]
    original = getattr(_saved.SavedSet, name)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)
    monkeypatch.setattr(_saved.SavedSet, name, counted)
    return calls


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for p in model.parameters():
        p._is_hf_initialized = True  # type: ignore[attr-defined]  # as transformers marks them: private
    return model


def test_plain_packs_and_unpacks_never_enter_python(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    packs, unpacks, reads = (_count(monkeypatch, n) for n in ("pack", "unpack", "read"))
    model, x = _mlp(), torch.randn(5, 8)
    with kvguard.guard_autograd(action="raise") as g:
        for _ in range(3):
            model(x).square().sum().backward()
    assert (packs[0], unpacks[0], reads[0]) == (0, 0, 0)
    assert g.protected_count > 0 and g.graphs == 3
    plain = _mlp()
    for _ in range(3):
        plain(x).square().sum().backward()
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)  # bitwise


def test_a_write_to_memory_a_freed_saved_tensor_left_never_enters_python(
        engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    judged = _count(monkeypatch, "written_entries")
    x = torch.randn(64, requires_grad=True)
    y = torch.randn(64)
    with kvguard.guard_autograd(action="raise") as g:
        z = x * y  # saves x and y
        with pytest.raises(kvguard.MutationError):
            y.add_(1)  # y is saved: stopped
        assert judged[0] >= 1
        z.sum().backward()  # lets x and y go
        judged[0] = 0
        for _ in range(5):
            y.add_(1)  # no longer saved: the hook has forgotten its memory
            x.detach().mul_(2)
    assert judged[0] == 0
    assert len(g.report.events) == 1


def test_a_write_to_a_c_packed_saved_tensor_names_its_node_and_line(engine: str) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with kvguard.guard_autograd(action="raise"):
        y = torch.tanh(x + 1)  # saves its result
        with pytest.raises(kvguard.MutationError) as info:
            y.mul_(2)
        y.sum().backward()
    event = info.value.event
    assert event.path == "<saved by TanhBackward0: result>" and event.blocked
    assert event.placed_at == f"test_autograd_cost.py:{_line('y = torch.tanh(x + 1)')}"
    assert torch.allclose(x.grad, 1 - torch.tanh(x.detach() + 1) ** 2)


def test_a_c_packed_tensor_written_where_kvguard_let_it_fails_backward_in_pytorchs_words(engine: str) -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(kvguard.MutationWarning), kvguard.guard_autograd(action="warn"):
        y = x.exp()
        y.add_(1)  # let through
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            y.sum().backward()
    assert "is at version 1; expected version 0 instead" in str(info.value)
    assert f"test_autograd_cost.py:{_line('y = x.exp()')}" in str(info.value)


def test_saved_rows_go_with_the_guard(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph outlives its guard: its saved tensors leave the hook at the guard's exit."""
    x = torch.randn(32, requires_grad=True)
    with kvguard.guard_autograd(action="raise"):
        y = x.sigmoid()
    judged = _count(monkeypatch, "written_entries")
    with kvguard.guard({"w": torch.zeros(2)}, action="raise"):  # keeps the hook's callback on
        y.detach().add_(0)  # not watched: the guard has ended
    assert judged[0] == 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
