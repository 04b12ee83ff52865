"""Shared test fixtures: every test must leave the dispatch-mode stack as it found it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def no_leaked_dispatch_mode():
    before = torch._C._len_torch_dispatch_stack()
    yield
    assert torch._C._len_torch_dispatch_stack() == before, "a dispatch mode leaked out of the test"
