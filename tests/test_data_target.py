"""`guard_data()` / `KVGUARD_TARGETS=data`: what a dataset returned stays as it was returned.

Megatron-LM !4164 (megatron-core 0.14.0's `GPTDataset.__getitem__`) handed out its cached
loss mask itself, and the next sample's `loss_mask[labels == pad] = 0.0` wrote into every
earlier sample's mask. The replica below keeps that shape.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, TensorDataset

import kvguard
from tests.processes import run_python
from tests.setitem_ops import MASK_FILL

PAD = 0


def line_of(marker: str) -> int:
    return next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if marker in text and "line_of(" not in text)


class GPTDataset(Dataset):  # type: ignore[type-arg]
    """The shape of megatron-core 0.14.0's GPTDataset: a cached loss mask, written per sample."""

    def __init__(self, fixed: bool = False) -> None:
        self.fixed = fixed
        self.cached_loss_mask: Any = None
        self.tokens = torch.tensor([[5, 0, 7, 0], [0, 3, 3, 4], [1, 2, 0, 9]])

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:  # GETITEM
        labels = self.tokens[idx].clone()
        if self.cached_loss_mask is None:
            self.cached_loss_mask = torch.ones(4)
        loss_mask = self.cached_loss_mask.clone() if self.fixed else self.cached_loss_mask
        loss_mask[labels == PAD] = 0.0  # MASK-WRITE
        return {"labels": labels, "loss_mask": loss_mask}


def test_the_cached_mask_written_for_the_next_sample_is_stopped_at_its_line() -> None:
    ds = GPTDataset()
    first = ds[0]  # before the guard: not protected
    with pytest.raises(kvguard.MutationError) as caught:
        with kvguard.guard_data(action="raise"):
            sample = ds[0]
            ds[1]
    event = caught.value.event
    assert (event.path, event.op, event.lineno) == ("GPTDataset[0]['loss_mask']", MASK_FILL,
                                                   line_of("# MASK-WRITE"))
    assert event.placed_at == f"test_data_target.py:{line_of('# GETITEM')}"
    assert torch.equal(sample["loss_mask"], torch.tensor([1.0, 0.0, 1.0, 0.0])) and first is not None


def test_the_fixed_dataset_writes_only_what_it_is_building() -> None:
    with kvguard.guard_data(action="raise") as g:
        ds = GPTDataset(fixed=True)
        masks = [ds[i]["loss_mask"] for i in range(3)]
    assert not g.report.events and g.protected_count == 6
    assert [m.tolist() for m in masks] == [[1, 0, 1, 0], [0, 1, 1, 1], [1, 1, 0, 1]]


def test_through_a_dataloader_subset_and_concat_the_inner_dataset_names_it() -> None:
    ds = ConcatDataset([Subset(GPTDataset(), [2, 0]), GPTDataset(fixed=True)])
    with kvguard.guard_data(action="record") as g:
        for _ in DataLoader(ds, batch_size=2):
            pass
    assert {e.path for e in g.report.events} == {"GPTDataset[2]['loss_mask']"}  # Subset's 0 is GPTDataset's 2


def test_a_transform_that_writes_a_cached_tensor() -> None:
    class Normalize:  # torchvision-style, in place
        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            return image.sub_(0.5)  # TRANSFORM

    class Images(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.cache: dict[int, torch.Tensor] = {}
            self.transform = Normalize()

        def __len__(self) -> int:
            return 2

        def __getitem__(self, idx: int) -> torch.Tensor:
            if idx not in self.cache:
                self.cache[idx] = torch.ones(3)
            return self.transform(self.cache[idx])

    with kvguard.guard_data(action="record") as g:
        ds = Images()
        ds[1]
        ds[1]  # the second epoch normalises the cached image again
    assert [(e.path, e.lineno) for e in g.report.events] == [("Images[1]", line_of("# TRANSFORM"))]


def test_a_collate_function_writing_a_sample_in_place() -> None:
    def collate(batch: list[torch.Tensor]) -> torch.Tensor:
        for sample in batch:
            sample.mul_(2)  # COLLATE
        return torch.stack(batch)

    data = torch.arange(6.0).reshape(3, 2)
    with kvguard.guard_data(action="record") as g:
        for _ in DataLoader(TensorDataset(data), batch_size=3, collate_fn=lambda b: collate([s[0] for s in b])):
            pass
    assert [(e.path, e.lineno) for e in g.report.events] == [
        (f"TensorDataset[{i}][0]", line_of("# COLLATE")) for i in range(3)]
    assert torch.equal(data, torch.arange(6.0).reshape(3, 2) * 2)  # the dataset's own storage changed


def test_getitems_names_each_sample_and_the_wrapping_goes_with_the_last_guard() -> None:
    class Batched(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.rows = torch.zeros(4, 2)

        def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
            return [self.rows[i] for i in indices]

    original = GPTDataset.__dict__["__getitem__"]
    with kvguard.guard_data(action="record") as g:
        ds = Batched()
        assert GPTDataset.__dict__["__getitem__"] is not original
        rows = ds.__getitems__([3, 1])
        rows[1].add_(1)
    assert [e.path for e in g.report.events] == ["Batched[1]"]
    assert GPTDataset.__dict__["__getitem__"] is original and "__kvguard_data__" not in vars(Batched.__getitems__)


def test_a_class_defined_inside_the_guard_is_wrapped_and_one_defined_after_it_is_not() -> None:
    with kvguard.guard_data(action="record") as g:
        assert "__init_subclass__" in vars(Dataset)

        class Inside(Dataset):  # type: ignore[type-arg]
            def __getitem__(self, i: int) -> torch.Tensor:
                return torch.zeros(2)

        Inside()[0].add_(1)
    assert [e.path for e in g.report.events] == ["Inside[0]"]
    assert "__init_subclass__" not in vars(Dataset) and "__kvguard_data__" not in vars(Inside.__getitem__)

    class After(Dataset):  # type: ignore[type-arg]
        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(2)

    assert "__kvguard_data__" not in vars(After.__getitem__)


def test_every_subclass_is_told_and_the_bases_own_init_subclass_runs_and_comes_back() -> None:
    """`on_every_subclass`, which the data guard and the weights kind share: the classes so far, the
    ones defined until the undo (after the base's own `__init_subclass__`, with its keywords)."""
    from kvguard._torch.patches import on_every_subclass

    class Base:
        def __init_subclass__(cls, tag: str = "", **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            cls.tag = tag  # type: ignore[attr-defined]

    class Old(Base, tag="old"):
        pass

    class OldChild(Old):
        pass

    own = vars(Base)["__init_subclass__"]
    now: list[type] = []
    later: list[tuple[type, str]] = []
    undo = on_every_subclass(Base, now.append, later=lambda cls: later.append((cls, cls.tag)))  # type: ignore[attr-defined]
    assert sorted(c.__name__ for c in now) == ["Old", "OldChild"]

    class New(Base, tag="new"):
        pass

    assert later == [(New, "new")]
    undo()
    assert vars(Base)["__init_subclass__"] is own

    class Newer(Base, tag="newer"):
        pass

    assert later == [(New, "new")] and Newer.tag == "newer"  # type: ignore[attr-defined]


@pytest.mark.parametrize("clone", [False, True], ids=["view", "copy"])
def test_a_sample_returned_after_a_dropped_one_is_protected_too(clone: bool) -> None:
    """A dropped sample's id is often the next one's (CPython reuses the memory): the next
    sample must not be taken for one already waiting."""
    class Rows(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.rows = torch.zeros(8, 2)

        def __getitem__(self, i: int) -> torch.Tensor:
            return self.rows[i].clone() if clone else self.rows[i]

    with kvguard.guard_data(action="record") as g:
        ds, kept = Rows(), []
        for i in range(8):
            sample = ds[i]
            if i % 2:
                kept.append(sample)
            del sample  # the even ones die before the next is returned
        for sample in kept:
            sample.add_(1)  # KEPT
    assert [(e.path, e.lineno) for e in g.report.events] == [(f"Rows[{i}]", line_of("# KEPT")) for i in (1, 3, 5, 7)]
    assert g.protected_count == 8


def test_a_main_process_whose_workers_loaded_everything_says_it_checked_nothing_here() -> None:
    from kvguard._kinds import DATA
    from kvguard._report.tally import Tally

    tally = Tally()
    tally.target(DATA.word).calls = 1  # the process guard was entered; no dataset returned a tensor here
    assert tally.lines() == ["kvguard: data: no dataset returned a tensor here, so no write was checked "
                             "(DataLoader workers say their own)"]


JOB = textwrap.dedent("""\
    import sys
    import torch
    from torch.utils.data import DataLoader, Dataset

    class GPTDataset(Dataset):
        def __init__(self):
            self.cached_loss_mask = None
            self.tokens = torch.tensor([[5, 0, 7, 0], [0, 3, 3, 4], [1, 2, 0, 9], [4, 4, 0, 4]])
        def __len__(self):
            return 4
        def __getitem__(self, idx):
            labels = self.tokens[idx].clone()
            if self.cached_loss_mask is None:
                self.cached_loss_mask = torch.ones(4)
            loss_mask = self.cached_loss_mask
            loss_mask[labels == 0] = 0.0
            return {"labels": labels, "loss_mask": loss_mask}

    if __name__ == "__main__":
        for batch in DataLoader(GPTDataset(), batch_size=2, num_workers=2):
            pass
        print("not caught")
""")


def test_the_switch_reaches_dataloader_workers(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    done = run_python("-m", "kvguard", "run", "--", sys.executable, script, KVGUARD="raise", KVGUARD_TARGETS="data")
    assert done.returncode == 1 and "not caught" not in done.stdout, done.stdout + done.stderr
    assert "kvguard.MutationError: Caught MutationError in DataLoader worker process" in done.stderr
    assert f"GPTDataset[0]['loss_mask'] would be modified in place by {MASK_FILL} at job.py:16" \
        in done.stderr
    assert "kvguard [DataLoader worker 0]: data: " in done.stderr


WORKERS_JOB = textwrap.dedent("""\
    import sys
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Rows(Dataset):
        def __init__(self, cached):
            self.cached = cached
            self.cache = torch.ones(4)
        def __len__(self):
            return 8
        def __getitem__(self, idx):
            if self.cached:
                self.cache.add_(1)  # CACHE-WRITE
                return {"x": self.cache}
            return {"x": torch.full((4,), float(idx)), "y": torch.zeros(2)}

    if __name__ == "__main__":
        method, persistent, cached, held = sys.argv[1], sys.argv[2] == "persistent", "cached" in sys.argv, "held" in sys.argv
        ds = Rows(cached)
        if "quiet-main" not in sys.argv:
            ds[0]  # the main process loads two samples itself (a cached dataset's write: one here)
            ds[1]
        loader = DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=persistent,
                            multiprocessing_context=method)
        if held:  # an iterator still alive at exit, its workers mid-epoch
            it = iter(loader)
            next(it)  # worker 0's first batch
            next(it)  # worker 1's: each worker has loaded before exit (one still starting says nothing)
        else:
            for epoch in range(2):
                for batch in loader:
                    pass
        print("done")
""")

WORKER_LINE = re.compile(r"^kvguard \[DataLoader worker (\d)\]: data: (\d+) tensors? returned by datasets protected, "
                         r"(no in-place writes|(\d+) writes? reported above)$", re.M)


def _run_workers_job(tmp_path: Path, *args: str, action: str = "warn") -> tuple[Any, Any, dict[str, Any]]:
    """The job under KVGUARD_TARGETS=data with a report directory; its run, `kvguard report`'s run
    and that report's one run as JSON."""
    import json

    script = tmp_path / "workers_job.py"
    script.write_text(WORKERS_JOB)
    reports = tmp_path / "reports"
    job = run_python("-m", "kvguard", "run", "--", sys.executable, script, *args, KVGUARD=action,
                     KVGUARD_TARGETS="data", KVGUARD_REPORT_DIR=str(reports), timeout=300)
    report = run_python("-m", "kvguard", "report", reports)
    (described,) = json.loads(run_python("-m", "kvguard", "report", reports, "--json").stdout)["runs"]
    return job, report, described


@pytest.mark.parametrize("method, persistent", [
    ("fork", "persistent"), ("fork", "per-epoch"), ("spawn", "persistent"),
    pytest.param("spawn", "per-epoch", marks=pytest.mark.slow),
])
def test_a_clean_run_with_workers_is_proven_clean_by_the_report(tmp_path: Path, method: str, persistent: str) -> None:
    """Each worker says its line as it ends (persistent ones too, which are shut down at the
    interpreter's exit) and writes a summary record, so `kvguard report` proves the run clean:
    every tensor the workers loaded is counted once, the main process's own sample too."""
    job, report, described = _run_workers_job(tmp_path, method, persistent)
    assert job.returncode == 0 and "done" in job.stdout, job.stdout + job.stderr
    lines = WORKER_LINE.findall(job.stderr)
    ends = 1 if persistent == "persistent" else 2  # per-epoch workers end after each of the 2 epochs
    assert sorted(worker for worker, *_ in lines) == sorted(["0", "1"] * ends), job.stderr
    assert all(found == "no in-place writes" for _, _, found, _ in lines), job.stderr
    # 8 samples of 2 tensors an epoch, over the workers' lifetimes (and 2 of them in the main process)
    assert sum(int(n) for _, n, _, _ in lines) == 16 * 2
    assert job.stderr.count("kvguard: data:") == 1  # the main process's line; a spawned worker's not twice
    assert report.returncode == 0, report.stdout + report.stderr
    assert described["status"] == "clean" and described["protected"] == 16 * 2 + 2 * 2, described
    assert described["processes"] == 1 + 2 * ends and not described["notes"], described


def test_writes_in_workers_under_warn_are_reported_with_no_killed_worker(tmp_path: Path) -> None:
    """A cached tensor written by the dataset in the main process (once) and in each worker: the
    report counts each write once (a forked worker does not count its parent's again), and no
    worker that ended normally is said to have been killed."""
    job, report, described = _run_workers_job(tmp_path, "fork", "persistent", "cached")
    assert job.returncode == 0, job.stdout + job.stderr
    # 4 samples a worker an epoch, each a write to the cache the main process had returned
    assert sorted(WORKER_LINE.findall(job.stderr)) == [("0", "0", "8 writes reported above", "8"),
                                                       ("1", "0", "8 writes reported above", "8")], job.stderr
    assert report.returncode == 1, report.stdout + report.stderr
    assert "wrote no summary record" not in report.stdout and not described["notes"], described
    assert described["status"] == "events" and described["writes"] == 1 + 16 and described["processes"] == 3
    (row,) = described["rows"]
    write_line = next(n for n, text in enumerate(WORKERS_JOB.splitlines(), 1) if "# CACHE-WRITE" in text)
    assert (row["site"], row["writes"]) == (f"workers_job.py:{write_line}", 17)


@pytest.mark.slow  # a variant: kept, the clean and warn runs with workers
def test_workers_of_an_iterator_still_held_at_exit_end_normally(tmp_path: Path) -> None:
    """`it = iter(loader); next(it)` and exit: torch would leave the workers to be terminated;
    they end as a deleted iterator's do, each with its line and summary record."""
    job, report, described = _run_workers_job(tmp_path, "fork", "per-epoch", "held")
    assert job.returncode == 0, job.stdout + job.stderr
    assert sorted(worker for worker, *_ in WORKER_LINE.findall(job.stderr)) == ["0", "1"], job.stderr
    assert report.returncode == 0 and described["status"] == "clean", report.stdout + report.stderr


@pytest.mark.slow  # a variant: kept, the clean and warn runs with workers
def test_under_raise_the_workers_summaries_count_the_stopped_write(tmp_path: Path) -> None:
    job, report, described = _run_workers_job(tmp_path, "fork", "persistent", "cached", "quiet-main",
                                              action="raise")
    assert job.returncode == 1 and "done" not in job.stdout, job.stdout + job.stderr
    assert "kvguard.MutationError: Caught MutationError in DataLoader worker process" in job.stderr
    assert report.returncode == 1 and "wrote no summary record" not in report.stdout, report.stdout
    assert described["status"] == "events" and described["writes"] >= 1, described


def _summary(pid: int, targets: dict[str, tuple[int, int]], writes: int = 0) -> str:
    import json

    return json.dumps({"schema": 1, "record": "summary", "run": "r", "host": "h", "pid": pid, "rank": None,
                       "calls": sum(c for c, _ in targets.values()), "writes": writes, "sites": [],
                       "protected": sum(p for _, p in targets.values()),
                       "targets": {label: {"calls": c, "protected": p, "writes": 0}
                                   for label, (c, p) in targets.items()}})


@pytest.mark.parametrize("main, workers, status", [
    ({"data": (1, 0)}, [{"data": (1, 8)}, {"data": (1, 8)}], "clean"),  # the workers loaded it all
    ({"data": (1, 0)}, [{"data": (1, 0)}], "unproven"),  # no process protected anything
    ({"data": (1, 0)}, [], "unproven"),  # no workers, and the main process loaded nothing
    ({"data": (1, 0), "m:f(rd)": (2, 0)}, [{"data": (1, 8)}], "unproven"),  # a target that held nothing
    ({"autograd": (1, 0)}, [{"data": (1, 8)}], "unproven"),  # another word's guard that held nothing
], ids=["workers-loaded", "nothing-anywhere", "no-workers", "target-held-nothing", "autograd-held-nothing"])
def test_a_main_process_whose_workers_loaded_is_no_gap_and_nothing_else_is_excused(
        tmp_path: Path, main: dict[str, tuple[int, int]], workers: list[dict[str, tuple[int, int]]],
        status: str) -> None:
    from kvguard._report import read

    (tmp_path / "kvguard-rank0.jsonl").write_text(
        "\n".join([_summary(1, main)] + [_summary(2 + i, w) for i, w in enumerate(workers)]) + "\n")
    (run,), _ = read.load(str(tmp_path))
    assert read.describe(run)["status"] == status


@pytest.fixture(scope="module")
def megatron_core_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """megatron-core 0.14.0 (Megatron-LM !4164's bug) and 0.15.0 (its fix), unpacked, not installed."""
    import subprocess
    import zipfile

    out = tmp_path_factory.mktemp("megatron")
    roots = {}
    for version in ("0.14.0", "0.15.0"):
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", str(out / version), f"megatron-core=={version}"],
                           check=True, capture_output=True, timeout=300)
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"cannot download megatron-core {version} here: {exc}")
        (wheel,) = (out / version).glob("megatron_core-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(out / version / "site")
        roots[version] = out / version / "site"
    return roots


@pytest.mark.slow
def test_real_megatron_core_gpt_dataset_caught_at_its_line_and_the_fix_clean(
        megatron_core_wheels: dict[str, Path]) -> None:
    job = Path(__file__).parent / "fake_frameworks" / "jobs" / "megatron_gpt_data.py"

    def run(version: str) -> Any:
        path = os.pathsep.join([str(megatron_core_wheels[version]), os.environ.get("PYTHONPATH", "")])
        return run_python("-W", "ignore", "-m", "kvguard", "run", "--", sys.executable, "-W", "ignore", job,
                          KVGUARD="raise", KVGUARD_TARGETS="data", PYTHONPATH=path, timeout=300)

    buggy = run("0.14.0")
    assert buggy.returncode == 1, buggy.stdout + buggy.stderr
    assert ("kvguard.MutationError: GPTDataset[0]['loss_mask'] would be modified in place by "
            f"{MASK_FILL} at gpt_dataset.py:211\n"
            "  code     loss_mask[labels == self._pad_token_id] = 0.0\n") in buggy.stderr
    fixed = run("0.15.0")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "GPTDataset 2 " in fixed.stdout
    assert fixed.stderr.rstrip().endswith("tensors returned by datasets protected, no in-place writes")
