"""The schedule hook: what `forward_backward_func` returns stays protected until logged.

Megatron's own schedules allocate on CUDA even without pipelining, so these tests drive
a schedule of our own with the same contract: keyword arguments, `forward_step_func`
returning `(output, loss_func)`, `loss_func` returning `(loss, {name: tensor})`, one
dict per microbatch in the returned `forward_data_store`, `[]` on a stage that is not
the last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import kvguard
from kvguard_megatron import GuardedSchedule, guard_schedule

ROOT = Path(__file__).resolve().parents[2]
MICROBATCHES = 2


def forward_backward_no_pipelining(*, forward_step_func: Any, data_iterator: Iterator[Any], model: Any,
                                   num_microbatches: int, seq_length: int, micro_batch_size: int,
                                   forward_only: bool = False, is_last_stage: bool = True) -> list[dict[str, Any]]:
    """Megatron's no-pipelining schedule, reduced to its contract, on CPU."""
    forward_data_store: list[dict[str, Any]] = []
    for _ in range(num_microbatches):
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        if not is_last_stage:
            continue
        loss, loss_reduced = loss_func(output_tensor)
        forward_data_store.append(loss_reduced)
        if not forward_only:
            (loss / num_microbatches).backward()
    return forward_data_store


def loss_func(target: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = torch.nn.functional.mse_loss(output_tensor, target)
    return loss, {"lm loss": loss.detach().clone().view(1), "num tokens": torch.tensor([target.numel()])}


def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    x, y = next(data_iterator)
    return model(x), partial(loss_func, y)


def batches(seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def train_step(schedule: Any, model: torch.nn.Module, data: Iterator[Any], **kwargs: Any) -> Any:
    return schedule(forward_step_func=forward_step, data_iterator=data, model=model,
                    num_microbatches=MICROBATCHES, seq_length=8, micro_batch_size=8, **kwargs)


def log_in_place(losses: list[dict[str, torch.Tensor]]) -> float:
    """The bug: average in place (as an in-place all_reduce then divide would) instead of on a copy."""
    total = losses[0]["lm loss"]
    for other in losses[1:]:
        total += other["lm loss"]  # BUG: total IS losses[0]['lm loss']
    return float(total.div_(len(losses)))


def log_on_a_copy(losses: list[dict[str, torch.Tensor]]) -> float:
    total = torch.stack([d["lm loss"] for d in losses]).sum(0)  # a new tensor: reduce it in place freely
    return float(total.div_(len(losses)))


@pytest.fixture
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def test_a_write_before_the_next_call_raises_at_the_next_call(model: torch.nn.Module) -> None:
    schedule = guard_schedule(forward_backward_no_pipelining)
    data = batches()
    losses = train_step(schedule, model, data)
    assert schedule.guarded == 1
    log_in_place(losses)
    with pytest.raises(kvguard.MutationError) as info:
        train_step(schedule, model, data)
    event = info.value.event
    assert event.path == "losses_reduced[0]['lm loss']" and event.kind == "unobserved"
    assert (event.filename, event.function) == (__file__, "train_step"), "the trainer's line, not kvguard's"
    assert event.code.startswith("return schedule(")
    assert "losses_reduced[0]['lm loss']" in str(info.value)
    assert schedule.guarded == 0 and schedule.calls == 1, "stopped before the next step ran"


def test_clean_logging_over_several_steps(model: torch.nn.Module) -> None:
    schedule = guard_schedule(forward_backward_no_pipelining, action="record")
    data = batches()
    for _ in range(3):
        log_on_a_copy(train_step(schedule, model, data))
    reports = schedule.release()
    assert [r.ok for r in reports] == [True] and schedule.calls == 3 and schedule.guarded == 0
    assert schedule.release() == [], "a second release has nothing left"


def test_until_release_keeps_every_result_until_release(model: torch.nn.Module) -> None:
    schedule = guard_schedule(forward_backward_no_pipelining, action="record", until="release")
    data = batches()
    first = train_step(schedule, model, data)
    second = train_step(schedule, model, data)
    assert schedule.guarded == 2
    log_on_a_copy(second)
    log_in_place(first)  # logged late, every few steps, as trainers do with log intervals
    reports = schedule.release()
    assert [[e.path for e in r.events] for r in reports] == [["losses_reduced[0]['lm loss']"], []]
    assert schedule.reports == reports


def test_a_stage_that_is_not_the_last_returns_nothing_to_guard(model: torch.nn.Module) -> None:
    schedule = guard_schedule(forward_backward_no_pipelining)
    assert train_step(schedule, model, batches(), is_last_stage=False) == []
    assert (schedule.calls, schedule.unguarded, schedule.guarded) == (1, 1, 0)
    assert schedule.release() == []  # and no GuardWarning for an empty guard (warnings are errors here)


def test_level_full_stops_the_write_at_the_trainer_s_line(model: torch.nn.Module) -> None:
    schedule = guard_schedule(forward_backward_no_pipelining, level="full")
    losses = train_step(schedule, model, batches())
    before = losses[0]["lm loss"].clone()
    with pytest.raises(kvguard.MutationError) as info:
        log_in_place(losses)
    assert info.value.event.op == "aten.add_.Tensor" and info.value.event.function == "log_in_place"
    assert torch.equal(losses[0]["lm loss"], before), "raised before the write"
    schedule.release()  # the error was read: releasing is clean, and the mode leaves the stack


def test_level_full_released_inside_another_guard_leaves_that_guard_working(model: torch.nn.Module) -> None:
    schedule = guard_schedule(forward_backward_no_pipelining, level="full", action="record")
    losses = train_step(schedule, model, batches())
    other = {"x": torch.zeros(3)}
    with kvguard.guard(other, action="record") as g:
        schedule.release()  # not the innermost mode: removes only its own
        other["x"].add_(1)
    assert [e.path for e in g.report.events] == ["other['x']"]
    assert losses[0]["lm loss"].numel() == 1


def test_the_wrapper_looks_like_the_schedule() -> None:
    schedule = guard_schedule(forward_backward_no_pipelining)
    assert isinstance(schedule, GuardedSchedule)
    assert schedule.__wrapped__ is forward_backward_no_pipelining
    assert schedule.__name__ == "forward_backward_no_pipelining"
    assert "until=next_call level=light" in repr(schedule)


@pytest.mark.parametrize(("options", "error"), [
    ({"until": "later"}, kvguard.ConfigError),
    ({"action": "explode"}, kvguard.ConfigError),
    ({"level": "medium"}, kvguard.ConfigError),
])
def test_bad_options_fail_when_wrapping_not_mid_training(options: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        guard_schedule(forward_backward_no_pipelining, **options)


def test_wrapping_something_that_is_not_a_function_says_what_to_pass() -> None:
    with pytest.raises(TypeError, match="get_forward_backward_func"):
        guard_schedule(None)  # type: ignore[arg-type]


def test_protection_still_open_at_exit_is_checked_then(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch
        from kvguard_megatron import guard_schedule

        def schedule(**kwargs):
            return [{"lm loss": torch.tensor([2.0])}]

        fbf = guard_schedule(schedule, action="warn")
        losses = fbf()
        losses[0]["lm loss"] /= 2  # BUG: in place, on the returned tensor
        print("done")
    """))
    reports = tmp_path / "reports"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", KVGUARD_REPORT_DIR=str(reports), PYTHONPATH=str(ROOT), COLUMNS="120")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "done" in result.stdout, result.stderr
    assert "losses_reduced[0]['lm loss']" in result.stderr and "still protected at interpreter exit" in result.stderr
    records = [json.loads(line) for line in (reports / "kvguard-rank0.jsonl").read_text().splitlines()]
    assert [r["record"] for r in records] == ["header", "event", "summary"]
    assert records[1]["path"] == "losses_reduced[0]['lm loss']" and records[2]["writes"] == 1
