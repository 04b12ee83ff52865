"""Shared test fixtures: every test must leave torch as it found it.

No dispatch mode left on the stack, and `torch.utils.swap_tensors` (which an active
guard wraps) restored: a guard left open by one test would otherwise change the next.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def no_leaked_guard():
    before = torch._C._len_torch_dispatch_stack()
    swap = torch.utils.swap_tensors
    yield
    assert torch._C._len_torch_dispatch_stack() == before, "a dispatch mode leaked out of the test"
    assert torch.utils.swap_tensors is swap, "a guard was left open: swap_tensors is still wrapped"
