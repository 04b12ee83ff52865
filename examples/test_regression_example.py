"""One-line regression tests for an in-place mutation bug, with kvguard's pytest plugin.

    pytest examples/test_regression_example.py

`shape_rewards_buggy` scales the per-token KL *in place*, so the KL its caller keeps in
`rollout_data["kl"]` for logging silently changes; `shape_rewards` is the one-line fix.
The line that guards each test is marked `# <- the one line`. The buggy cases are written
so this file passes: a test that expects the error, and one marked as an expected failure.
"""

from __future__ import annotations

import pytest
import torch

import kvguard


def shape_rewards_buggy(rollout_data: dict, kl_coef: float = 0.1) -> list[torch.Tensor]:
    rewards = []
    for k in rollout_data["kl"]:
        k *= -kl_coef  # BUG: k IS rollout_data["kl"][i]
        rewards.append(k)
    return rewards


def shape_rewards(rollout_data: dict, kl_coef: float = 0.1) -> list[torch.Tensor]:
    return [k * -kl_coef for k in rollout_data["kl"]]  # new tensors: the logged KL stays intact


@pytest.fixture
def rollout_data() -> dict:
    return {"kl": [torch.randn(8) for _ in range(2)], "rewards": [1.0, 0.0]}


def test_fixture_catches_the_bug(mutation_guard, rollout_data):
    mutation_guard.protect(rollout_data, name="rollout_data", action="raise")  # <- the one line
    with pytest.raises(kvguard.MutationError, match=r"rollout_data\['kl'\]\[0\] would be modified in place"):
        shape_rewards_buggy(rollout_data)


@pytest.mark.kvguard(arg="rollout_data")  # <- the one line
def test_marker_passes_on_the_fix(rollout_data):
    kl_before = [k.clone() for k in rollout_data["kl"]]
    shape_rewards(rollout_data)
    assert all(torch.equal(a, b) for a, b in zip(rollout_data["kl"], kl_before))


# Without the xfail mark this test FAILS, its message the report: path, op, the line `k *= -kl_coef`.
@pytest.mark.xfail(raises=kvguard.MutationError, strict=True, reason="the bug this file shows")
@pytest.mark.kvguard(arg="rollout_data", action="raise")  # <- the one line
def test_marker_catches_the_bug(rollout_data):
    shape_rewards_buggy(rollout_data)
