"""Trainers as Ray actors (slime, verl), kvguard switched on by `KVGUARD*` variables only.

A real local Ray cluster on CPU (`ray.init(address="local", num_cpus=2)`), one per test,
with the actor and loss function of `examples/ray_job/`. The variables reach the actor the
three ways these frameworks pass them:

- inherited: exported in the driver's environment before a local `ray.init()` starts the
  cluster (verl's `main_ppo` on one node; slime's scripts export before `ray start --head`);
- on the actor: `ray.remote(runtime_env={"env_vars": ...})(TrainActor)`, what slime does
  with `--train-env-vars` (`slime/ray/actor_group.py`);
- on the job: `ray.init(runtime_env={"env_vars": ...})`, what verl's `run_ppo` does with
  `ray_kwargs.ray_init.runtime_env` (`verl/trainer/main_ppo.py`).

The test process is the driver and is never activated itself: it only sets variables.
Each test starts and stops a cluster (about 10-15 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import pytest

ray = pytest.importorskip("ray", reason="ray is in the ci extra (pip install -e .[ci])")

import kvguard  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LOSS = EXAMPLES / "ray_job" / "loss.py"
TARGET = "ray_job.loss:compute_advantages_and_returns(rollout_data)"
pytestmark = pytest.mark.slow  # a Ray cluster per test: CI runs them (-m slow)

TIMEOUT = 120  # seconds for any one ray.get: a hang fails the test instead of the CI job


@pytest.fixture
def driver_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A driver environment with no kvguard, launcher or Ray-address variables, `examples/` importable."""
    for name in list(os.environ):
        if name.startswith("KVGUARD") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
                                                  "RAY_ADDRESS"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Where the job's code is, as slime's runtime env sets PYTHONPATH: the cluster started
    # by `ray.init` inherits it, so `ray_job` imports in the actors as in the driver.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return monkeypatch


@contextmanager
def local_ray(runtime_env: Optional[dict[str, Any]] = None) -> Iterator[None]:
    """A new local cluster (never one already running on the machine), stopped in all cases."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=runtime_env,
             logging_level="warning")
    try:
        yield
    finally:
        ray.shutdown()


def kvguard_vars(action: str, reports: Path, **more: str) -> dict[str, str]:
    return {"KVGUARD": action, "KVGUARD_TARGETS": TARGET, "KVGUARD_REPORT_DIR": str(reports), **more}


def train_actor(**options: Any) -> Any:
    """`ray.remote(**options)(TrainActor)`, as slime's `RayTrainGroup` builds its actor class."""
    from ray_job.actor import TrainActor

    return ray.remote(num_cpus=0, **options)(TrainActor)


def close(actor: Any) -> None:
    """End the actor through `ray.actor.exit_actor()`, which runs its exit handlers."""
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.close.remote(), timeout=TIMEOUT)


def records(reports: Path, pid: int, kind: str, wait: float = 0.0) -> list[dict[str, Any]]:
    """The `kind` records that process `pid` wrote, waiting up to `wait` s for the first one."""
    deadline = time.monotonic() + wait
    while True:
        lines = [line for f in sorted(reports.glob("kvguard-rank*.jsonl")) for line in f.read_text().splitlines()]
        found = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a line still being appended
                continue
            if record["pid"] == pid and record["record"] == kind:
                found.append(record)
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def kvguard_report(reports: Path) -> tuple[int, dict[str, Any]]:
    """`python -m kvguard report DIR --json`: its exit status and output."""
    done = subprocess.run([sys.executable, "-m", "kvguard", "report", str(reports), "--json"],
                          capture_output=True, text=True, timeout=600)
    return done.returncode, json.loads(done.stdout)


def loss_line(text: str) -> int:
    return next(i for i, line in enumerate(LOSS.read_text().splitlines(), 1) if text in line)


def check_reports(reports: Path, pid: int, rank: Optional[int], world_size: Optional[int],
                  blocked: bool, run_id: Optional[str] = None) -> dict[str, Any]:
    """The actor's header, first event and exit summary, and `kvguard report` on the directory."""
    # The header is written when the target is patched, at the actor's `import ray_job.loss`,
    # before its `__init__` initialises torch.distributed: the rank comes with the events and
    # the summary.
    (header,) = records(reports, pid, "header")
    assert header["settings"]["targets"] == [TARGET]
    event = records(reports, pid, "event")[0]
    assert (event["path"], event["op"], event["blocked"]) == ("rollout_data['kl'][0]", "aten.mul_.Tensor", blocked)
    assert (Path(event["filename"]), event["lineno"]) == (LOSS, loss_line("k *= -args.kl_coef"))
    assert event["rank"] == rank
    (summary,) = records(reports, pid, "summary", wait=30)  # written by the actor's exit handler
    assert (summary["rank"], summary["world_size"], summary["calls"]) == (rank, world_size, 1)
    assert summary["blocked"] == (1 if blocked else 0)
    status, out = kvguard_report(reports)
    assert status == 1, out  # writes found
    (run,) = out["runs"]
    assert run["status"] == "events" and run["processes"] == 1 and run["calls"] == 1
    assert run_id is None or run["run"] == run_id
    assert run["ranks"] == ([] if rank is None else [rank])
    return summary


def test_variables_inherited_from_the_driver_environment(driver_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Exported before a local `ray.init()`: the cluster, and every actor in it, inherits them."""
    reports = tmp_path / "reports"
    for name, value in kvguard_vars("warn", reports).items():
        driver_env.setenv(name, value)
    with local_ray():
        actor = train_actor().remote(init_method=(tmp_path / "store").as_uri())
        seen = ray.get(actor.environment.remote(), timeout=TIMEOUT)
        assert seen["guarded"] and seen["pid"] != os.getpid() and seen["executable"] == sys.executable
        ray.get(actor.train_step.remote(), timeout=TIMEOUT)  # warn: the write happens, the step runs on
        close(actor)
        summary = check_reports(reports, seen["pid"], rank=0, world_size=1, blocked=False)
    assert summary["writes"] == 4 and len(summary["sites"]) == 2  # k *= ..., k[-1] += ... on both samples


def test_variables_on_the_actor_slime_train_env_vars(driver_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """slime's `--train-env-vars` lands in the training actors' `runtime_env`; raise stops the
    write, and the pickled `MutationError` reaches the driver through `ray.get`."""
    reports = tmp_path / "reports"
    with local_ray():
        env_vars = kvguard_vars("raise", reports, KVGUARD_RUN_ID="slime-1")
        actor = train_actor(runtime_env={"env_vars": env_vars}).remote(init_method=(tmp_path / "store").as_uri())
        bystander = train_actor().remote()  # same job, no env_vars: not activated
        seen, other = ray.get([actor.environment.remote(), bystander.environment.remote()], timeout=TIMEOUT)
        assert seen["guarded"] and seen["env"]["KVGUARD"] == "raise"
        assert not other["guarded"] and other["env"] == {}

        with pytest.raises(ray.exceptions.RayTaskError) as caught:
            ray.get(actor.train_step.remote(), timeout=TIMEOUT)
        error = caught.value.cause
        assert type(error) is kvguard.MutationError
        assert isinstance(caught.value, kvguard.MutationError)  # Ray's dual RayTaskError(MutationError)
        assert error.event is not None and error.event.path == "rollout_data['kl'][0]"
        assert (error.event.op, error.event.blocked) == ("aten.mul_.Tensor", True)
        assert error.report is not None and len(error.report.events) == 1
        assert "rollout_data['kl'][0] would be modified in place by aten.mul_.Tensor" in str(caught.value)

        from ray_job.loss import make_rollout
        rollout = make_rollout()
        intact = [(lp - ref).tolist() for lp, ref in zip(rollout["log_probs"], rollout["ref_log_probs"])]
        assert ray.get(actor.kl.remote(), timeout=TIMEOUT) == intact  # stopped before the write

        ray.get(bystander.train_step.remote(), timeout=TIMEOUT)  # the same bug, unguarded, unreported
        close(actor)
        close(bystander)
        check_reports(reports, seen["pid"], rank=0, world_size=1, blocked=True, run_id="slime-1")
        assert records(reports, other["pid"], "header") == []


def test_variables_on_the_job_verl_ray_init_runtime_env(driver_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """verl's `ray_kwargs.ray_init.runtime_env` goes to `ray.init(runtime_env=...)`: every actor
    of the job gets it. verl computes advantages in its `TaskRunner` actor, which does not
    initialise torch.distributed: its records carry no rank."""
    reports = tmp_path / "reports"
    with local_ray(runtime_env={"env_vars": kvguard_vars("record", reports, KVGUARD_RUN_ID="verl-1")}):
        actor = train_actor().remote()
        seen = ray.get(actor.environment.remote(), timeout=TIMEOUT)
        assert seen["guarded"] and seen["env"]["KVGUARD"] == "record"
        ray.get(actor.train_step.remote(), timeout=TIMEOUT)
        close(actor)
        summary = check_reports(reports, seen["pid"], rank=None, world_size=None, blocked=False, run_id="verl-1")
    assert summary["writes"] == 4 and len(records(reports, seen["pid"], "event")) == 4
