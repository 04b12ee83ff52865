"""Reports a long job can live with: one finding per site, bounded files, runs that prove themselves.

Env activation runs in real subprocesses through `python -m kvguard run` (the source-checkout
route, no .pth needed) on `examples/long_job`; the rest is checked in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import kvguard
from kvguard import _config, _ranks
from kvguard._guard.allow import Allowlist
from kvguard._paths import parse_patterns
from kvguard._errors import ConfigError
from kvguard._report.events import MutationEvent
from kvguard._report.files import SCHEMA
from kvguard._paths import collapse as pattern

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "long_job"
TARGET = "ppo_loss:compute_advantages_and_returns(rollout_data)"
LOSS = (JOB / "ppo_loss.py").read_text().splitlines()
MUL = 1 + next(i for i, line in enumerate(LOSS) if line.strip().startswith("k *= -args.kl_coef"))
ADD = 1 + next(i for i, line in enumerate(LOSS) if line.strip() == "k[-1] += reward")


def run(*args: str, env: dict[str, str] | None = None, cwd: Path = JOB) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with no kvguard, rank or Python settings inherited from the test run."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PYTHON", "TORCHELASTIC"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(JOB)]), COLUMNS="120")
    return subprocess.run([sys.executable, *args], env={**base, **(env or {})}, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def job(reports: Path, *train_args: str, action: str = "warn", **env: str) -> subprocess.CompletedProcess[str]:
    """The long job under `kvguard run`, writing reports to `reports`."""
    result = run("-m", "kvguard", "run", "--action", action, "--targets", TARGET, "--report-dir", str(reports),
                 "--", sys.executable, "train.py", *train_args, env=env)
    assert result.returncode == 0 and "train done" in result.stdout, result.stdout + result.stderr
    return result


def report(path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return run("-m", "kvguard", "report", str(path), "--width", "160", *options)


def records(reports: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for file in sorted(reports.glob("kvguard-rank*.jsonl"))
            for line in file.read_text().splitlines()]


def site_line(line: int, op: str, writes: str, calls: int, path: str = "rollout_data['kl'][*]") -> str:
    return (f"  ppo_loss.py:{line} {op}: {writes} writes to {path} in {calls} calls "
            f"(first: rollout_data['kl'][0], call 1)")


# -- the realistic scenario ------------------------------------------------------------------

def test_long_job_prints_one_panel_per_site_and_a_short_bounded_report(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    result = job(reports)  # 256 samples x 10 calls, 5,120 writes at 2 lines
    assert "logged KL intact in 0/10 steps" in result.stdout
    err = result.stderr
    assert err.count("kvguard: in-place write") == 2 and err.count("MutationWarning") == 0  # one report per site
    protected = records(reports)[-1]["protected"]
    assert protected > 10 * 256
    assert err.endswith("\n".join([
        f"kvguard: {TARGET}: 10 guarded calls, {protected:,} tensors protected, 5,120 writes at 2 sites",
        site_line(MUL, "aten.mul_.Tensor", "2,560", 10), site_line(ADD, "aten.add_.Tensor", "2,560", 10)]) + "\n")
    assert len(err.splitlines()) < 40
    (file,) = reports.iterdir()
    assert file.name == "kvguard-rank0.jsonl" and file.stat().st_size < 100_000
    kinds = [r["record"] for r in records(reports)]
    assert kinds == ["header"] + ["event"] * _config.DEFAULT_MAX_EVENTS + ["summary"]
    summary = records(reports)[-1]
    assert (summary["calls"], summary["writes"], summary["events_written"], summary["events_cut"]) == (
        10, 5120, 100, 5020)

    table = report(reports)
    assert table.returncode == 1, table.stderr
    lines = table.stdout.splitlines()
    assert re.fullmatch(rf"kvguard: run \S+ \(1 process\): 10 guarded calls, {protected:,} tensors protected, "
                        r"5,120 writes at 2 sites", lines[0])
    assert lines[1] == f"  {TARGET}: 10 guarded calls, {protected:,} tensors protected, 5,120 writes"
    assert sum(f"ppo_loss.py:{n} aten." in table.stdout for n in (MUL, ADD)) == 2
    assert "5,020 events past KVGUARD_MAX_EVENTS are counted above but not in the files" in table.stdout
    (described,) = json.loads(report(reports, "--json").stdout)["runs"]
    assert [(row["site"], row["writes"], row["calls"], row["paths"]) for row in described["rows"]] == [
        (f"ppo_loss.py:{MUL}", 2560, 10, ["rollout_data['kl'][*]"]),
        (f"ppo_loss.py:{ADD}", 2560, 10, ["rollout_data['kl'][*]"])]
    assert described["status"] == "events" and described["rows"][0]["first"]["path"] == "rollout_data['kl'][0]"


def test_fixed_job_leaves_a_header_and_summary_that_prove_it_clean(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    result = job(reports, "--fixed", "--samples", "8", "--steps", "3")
    assert result.stderr == f"kvguard: {TARGET}: 3 guarded calls, 96 tensors protected, no in-place writes\n"
    header, summary = records(reports)
    assert (header["record"], summary["record"]) == ("header", "summary")
    assert summary["calls"] == 3 and summary["writes"] == 0 and summary["protected"] > 0
    table = report(reports)
    assert table.returncode == 0, table.stdout + table.stderr
    assert table.stdout.endswith("3 guarded calls, 96 tensors protected, clean: no in-place writes to protected "
                                 f"tensors\n  {TARGET}: 3 guarded calls, 96 tensors protected, no in-place writes\n")


# -- grouping and caps -----------------------------------------------------------------------

@pytest.mark.parametrize("path, expected", [
    ("rollout_data['kl'][3]", "rollout_data['kl'][*]"),
    ("rd[0][12]['x']", "rd[*][*]['x']"),
    ("rd['a[0]'][-1]", "rd['a[0]'][*]"),  # an index inside a quoted key is part of the key
    ("rd.field", "rd.field"),
])
def test_paths_collapse_list_indices(path: str, expected: str) -> None:
    assert pattern(path) == expected


def test_report_keeps_events_up_to_the_cap_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    rd = {"k": [torch.ones(2) for _ in range(5)]}

    def write_all(action: str) -> kvguard.Guard:
        with kvguard.guard(rd, name="rd", action=action) as g:
            for k in rd["k"]:
                k.add_(1)
        return g

    assert len(write_all("record").report.events) == 5  # record, no cap set: every event
    monkeypatch.setenv("KVGUARD_MAX_EVENTS", "2")
    for action in ("record", "warn"):
        with pytest.warns(kvguard.MutationWarning) if action == "warn" else contextlib.nullcontext():
            g = write_all(action)
        assert (len(g.report.events), g.report.cut, g.report.ok) == (2, 3, False)
        assert "… and 3 more writes (3 past KVGUARD_MAX_EVENTS, counted only)" in g.report.format()


def test_file_cap_keeps_counts_exact(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    result = job(reports, "--samples", "8", "--steps", "2", action="record", KVGUARD_MAX_EVENTS="5")
    assert f"kvguard: {TARGET}: 2 guarded calls, 64 tensors protected, 32 writes at 2 sites" in result.stderr
    events = [r for r in records(reports) if r["record"] == "event"]
    summary = records(reports)[-1]
    assert len(events) == 5 and (summary["writes"], summary["events_cut"]) == (32, 27)
    assert summary["sites"][0]["writes"] == 16 and summary["sites"][0]["paths"] == {"rollout_data['kl'][*]": 16}


def test_bad_max_events_names_its_source() -> None:
    with pytest.raises(ConfigError, match="invalid event cap '-1' in the KVGUARD_MAX_EVENTS environment variable"):
        _config.parse_max_events("-1")


# -- run ids -------------------------------------------------------------------------------

def test_two_launches_into_one_directory_stay_two_runs(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    job(reports, "--samples", "4", "--steps", "2")
    job(reports, "--samples", "4", "--steps", "3")
    runs = list(dict.fromkeys(r["run"] for r in records(reports)))
    assert len(runs) == 2
    table = report(reports)
    assert table.returncode == 1
    heads = [line for line in table.stdout.splitlines() if line.startswith("kvguard: run")]
    assert heads == [f"kvguard: run {runs[0]} (1 process): 2 guarded calls, 32 tensors protected, 16 writes at 2 sites",
                     f"kvguard: run {runs[1]} (1 process): 3 guarded calls, 48 tensors protected, 24 writes at 2 sites"]
    only = json.loads(report(reports, "--run", runs[1], "--json").stdout)["runs"]
    assert [(r["run"], r["calls"], r["writes"]) for r in only] == [(runs[1], 3, 24)]
    missing = report(reports, "--run", "nope")
    assert missing.returncode == 2 and missing.stderr.startswith("kvguard: no run 'nope' in ")


def test_run_id_comes_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-7")
    assert _ranks.run_id() == "rdzv-7"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    monkeypatch.setenv("KVGUARD_RUN_ID", "from-parent")
    assert _ranks.run_id() == "from-parent"
    monkeypatch.delenv("KVGUARD_RUN_ID")
    made = _ranks.run_id()
    assert made.startswith(f"{socket.gethostname()}-{os.getpid()}-") and os.environ["KVGUARD_RUN_ID"] == made


def test_every_record_of_a_process_carries_one_run_id_and_rank(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    job(reports, "--samples", "2", "--steps", "1", RANK="3", WORLD_SIZE="4", TORCHELASTIC_RUN_ID="launch-1")
    (file,) = reports.iterdir()
    assert file.name == "kvguard-rank3.jsonl"
    assert {(r["run"], r["rank"]) for r in records(reports)} == {("launch-1", 3)}
    assert report(reports, "--rank", "3").returncode == 1
    other = report(reports, "--rank", "0")
    assert other.returncode == 2 and "no records of rank 0" in other.stderr


# -- intended writes -----------------------------------------------------------------------

def test_allow_patterns_let_intended_writes_happen_even_under_raise() -> None:
    rd = {"kl": [torch.ones(2), torch.ones(2)], "advantages": [torch.ones(2)]}
    with kvguard.guard(rd, name="rd", action="raise", allow=["rd['advantages'][*]", "rd['kl'][1]"]) as g:
        rd["advantages"][0].sub_(1)  # whitening after logging: meant
        rd["kl"][1].mul_(2)
        with pytest.raises(kvguard.MutationError, match=r"rd\['kl'\]\[0\] would be modified"):
            rd["kl"][0].mul_(2)
    assert torch.equal(rd["advantages"][0], torch.zeros(2)) and torch.equal(rd["kl"][1], torch.full((2,), 2.0))
    assert torch.equal(rd["kl"][0], torch.ones(2))
    assert [e.path for e in g.report.events] == ["rd['kl'][0]"]
    assert g.report.allowed == {"allow=rd['advantages'][*]": 1, "allow=rd['kl'][1]": 1}


def test_allow_block_lets_writes_through_with_its_reason() -> None:
    rd = {"advantages": [torch.ones(3)]}
    with kvguard.guard(rd, name="rd", action="raise") as g:
        with kvguard.allow("whiten in place, after logging"):
            rd["advantages"][0].sub_(1).div_(2)
        with pytest.raises(kvguard.MutationError, match=r"rd\['advantages'\]\[0\] would be modified"):
            rd["advantages"][0].add_(1)  # outside the block: reported again
    assert g.report.allowed == {"kvguard.allow('whiten in place, after logging')": 2}
    assert len(g.report.events) == 1 and not g.report.ok


@pytest.mark.parametrize("bad", ["rd['x'", "rd]["])
def test_bad_allow_patterns_name_their_source(bad: str) -> None:
    source = "the KVGUARD_ALLOW environment variable"
    with pytest.raises(ConfigError, match=re.escape(f"invalid allow pattern {bad!r} in {source}")):
        parse_patterns(f"rd['ok'],{bad}", source)
    with pytest.raises(ConfigError, match=re.escape("invalid allow pattern '' in kvguard.guard(allow=...)")):
        kvguard.guard({}, allow=[""])
    with pytest.raises(ConfigError, match=re.escape("kvguard.allow() takes a reason")):
        with kvguard.allow(" "):
            pass


def test_allow_patterns_split_on_commas_outside_brackets() -> None:
    assert parse_patterns("rd['a,b'][*], rd['c']", "x") == ("rd['a,b'][*]", "rd['c']")
    allow = Allowlist(["rd['a']"], "x")
    assert allow.reason("rd['a'][3]") == "allow=rd['a']" and allow.reason("rd['ab']") is None


def test_env_allow_counts_allowed_writes_in_the_summary_and_report(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    result = job(reports, "--samples", "4", "--steps", "2", KVGUARD_ALLOW="rollout_data['kl'][*]")
    assert result.stderr == (f"kvguard: {TARGET}: 2 guarded calls, 32 tensors protected, no in-place writes, "
                             "16 allowed\n"
                             "  allowed: 16 writes by allow=rollout_data['kl'][*]\n")
    table = report(reports)
    assert table.returncode == 0
    assert "  allowed: 16 writes by allow=rollout_data['kl'][*]" in table.stdout


# -- KVGUARD_CALLS -------------------------------------------------------------------------

@pytest.mark.parametrize("value, guarded", [
    ("", list(range(1, 11))), ("all", list(range(1, 11))), ("first:3", [1, 2, 3]), ("every:4", [1, 5, 9]),
    ("4-6", [4, 5, 6]),
])
def test_calls_selection(value: str, guarded: list[int]) -> None:
    calls = _config.parse_calls(value)
    assert [n for n in range(1, 11) if calls.selects(n)] == guarded
    assert str(calls) == (value or "all")


@pytest.mark.parametrize("bad", ["first", "first:0", "6-4", "every:x", "3"])
def test_bad_calls_name_their_source(bad: str) -> None:
    with pytest.raises(ConfigError, match=f"invalid call selection '{bad}' in the KVGUARD_CALLS environment"):
        _config.parse_calls(bad)


def test_unguarded_calls_are_counted(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    result = job(reports, "--samples", "2", "--steps", "10", KVGUARD_CALLS="every:4")
    assert result.stderr.splitlines()[-3] == (
        f"kvguard: {TARGET}: 3 guarded calls (7 left unguarded by KVGUARD_CALLS=every:4), 24 tensors protected, "
        "12 writes at 2 sites")
    summary = records(reports)[-1]
    assert (summary["calls"], summary["unguarded_calls"]) == (3, 7)
    assert "  note: 7 calls left unguarded by KVGUARD_CALLS" in report(reports).stdout


# -- every kind of guard writes report files -------------------------------------------------

def test_explicit_guards_decorators_and_pytest_write_report_files(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(textwrap.dedent("""
        import sys, torch, kvguard

        @kvguard.guarded("rd", action="record")
        def step(rd):
            rd["x"].add_(1)

        step({"x": torch.ones(2)})
        with kvguard.guard({"y": torch.ones(2)}, name="rd", action="record", report_dir=sys.argv[1]):
            pass
    """))
    env_dir, own_dir = tmp_path / "env", tmp_path / "own"
    assert run("script.py", str(own_dir), cwd=tmp_path, env={"KVGUARD_REPORT_DIR": str(env_dir)}).returncode == 0
    env_records, own_records = records(env_dir), records(own_dir)
    assert [r["record"] for r in env_records] == ["header", "event", "summary"]
    assert env_records[-1]["targets"]["rd"]["calls"] == 1 and env_records[-1]["writes"] == 1
    assert [r["record"] for r in own_records] == ["header", "summary"] and own_records[-1]["writes"] == 0
    assert own_records[-1]["protected"] == 1

    (tmp_path / "test_x.py").write_text(textwrap.dedent("""
        import pytest, torch

        @pytest.fixture
        def rd():
            return {"x": torch.ones(2)}

        @pytest.mark.kvguard(arg="rd", action="record")
        def test_x(rd):
            pass
    """))
    plugin_dir = tmp_path / "plugin"
    result = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "test_x.py", cwd=tmp_path,
                 env={"KVGUARD_REPORT_DIR": str(plugin_dir)})
    assert "1 passed" in result.stdout, result.stdout + result.stderr
    assert [r["record"] for r in records(plugin_dir)] == ["header", "summary"]
    assert report(plugin_dir).returncode == 0


# -- kvguard report: exit status and malformed input ------------------------------------------

def test_exit_status_two_for_nothing_and_for_text_that_is_no_report(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    nothing = report(tmp_path / "empty")
    assert (nothing.returncode, nothing.stdout) == (2, "")
    assert nothing.stderr == f"kvguard: no kvguard report records in {tmp_path / 'empty'}\n"
    text = tmp_path / "notes.txt"
    text.write_text("hello\nworld\n")
    garbage = report(text)
    assert garbage.returncode == 2
    assert garbage.stderr.splitlines() == [
        f"kvguard: skipped 2 malformed lines in {text} (first, line 1: not JSON: 'hello')",
        f"kvguard: no kvguard report records in {text}"]


def test_malformed_lines_are_named_and_the_rest_is_read(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    job(reports, "--fixed", "--samples", "2", "--steps", "1")
    file = next(reports.iterdir())
    file.write_text(file.read_text() + '{"path": "x"}\n[1, 2]\n{"schema": 99, "record": "event"}\n')
    result = report(reports)
    assert result.returncode == 0
    assert result.stderr == (f"kvguard: skipped 3 malformed lines in {file} (first, line 3: no schema field "
                             "(not a kvguard record, or one from kvguard 0.1))\n")


def test_a_process_without_summary_is_not_proof(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    job(reports, "--fixed", "--samples", "2", "--steps", "1")
    file = next(reports.iterdir())
    file.write_text(file.read_text().splitlines()[0] + "\n")  # the header only: killed before exit
    result = report(reports)
    assert result.returncode == 2
    assert "wrote no summary record (killed, or still running)" in result.stdout


# -- the schema ----------------------------------------------------------------------------

def test_records_carry_the_schema_and_the_readme_names_every_field(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    job(reports, "--samples", "2", "--steps", "1")
    readme = (ROOT / "docs" / "reports.md").read_text()  # the docs page the README links to
    section = readme[readme.index("## Report files"):readme.index("## `kvguard report`")]
    documented = set(re.findall(r"`([a-z_]+)`", section))
    seen: dict[str, set[str]] = {}
    for record in records(reports):
        assert record["schema"] == SCHEMA and isinstance(record["run"], str)
        seen.setdefault(record["record"], set()).update(record)
        for site in record.get("sites", []):
            seen["site"] = set(site) | set(site["first"])
        for target in record.get("targets", {}).values():
            seen["target"] = set(target)
    assert set(seen) == {"header", "event", "summary", "site", "target"}
    assert {f.name for f in dataclasses.fields(MutationEvent)} <= seen["event"]  # never renamed
    for kind, fields in seen.items():
        assert fields <= documented, f"{kind} fields missing from the README: {sorted(fields - documented)}"


# -- kvguard report never calls an inconsistent record clean ---------------------------------

def _record(kind: str, **fields: Any) -> str:
    base = {"schema": SCHEMA, "record": kind, "run": "r1", "time": 1.0, "host": "h", "pid": 7, "rank": None}
    return json.dumps({**base, **fields}) + "\n"


def _summary(**fields: Any) -> str:
    counts = {"calls": 3, "writes": 0, "sites": [], "protected": 6, "unguarded_calls": 0, "allowed": {},
              "events_written": 0, "events_cut": 0, "problems": [], "not_run": {},
              "targets": {TARGET: {"calls": 3, "protected": 6, "writes": 0}}}
    return _record("summary", **{**counts, **fields})


def _event(**fields: Any) -> str:
    return _record("event", path="rd['kl']", op="aten.mul_.Tensor", filename="/x/loss.py", lineno=3,
                   call=1, **fields)


def _report_of(tmp_path: Path, *lines: str) -> subprocess.CompletedProcess[str]:
    file = tmp_path / "kvguard-rank0.jsonl"
    file.write_text(_record("header") + "".join(lines))
    return report(file)


def test_a_consistent_clean_summary_is_clean_and_names_what_it_watched(tmp_path: Path) -> None:
    result = _report_of(tmp_path, _summary())
    assert result.returncode == 0, result.stdout
    assert result.stdout == ("kvguard: run r1 (1 process): 3 guarded calls, 6 tensors protected, clean: no in-place "
                             f"writes to protected tensors\n  {TARGET}: 3 guarded calls, 6 tensors protected, "
                             "no in-place writes\n")


def test_writes_counted_without_their_sites_are_not_clean(tmp_path: Path) -> None:
    result = _report_of(tmp_path, _summary(writes=5))
    assert result.returncode == 1, result.stdout
    assert result.stdout.splitlines()[0] == "kvguard: run r1 (1 process): 3 guarded calls, 6 tensors protected, " \
                                            "5 writes at 0 sites"
    assert ("note: a process (pid 7 on h)'s summary counts 5 writes, but its sites record 0: the writes were "
            "counted but their sites were not recorded") in result.stdout


@pytest.mark.parametrize("summary, note", [
    (_summary(), "has 1 event record in the files, but its summary counts 0 writes"),  # events, summary says 0
    (_summary(sites=[{"filename": "/x/loss.py", "lineno": 3, "op": "aten.mul_.Tensor", "writes": 2}]),
     "'s summary lists sites with 2 writes, but counts 0"),
])
def test_a_summary_that_contradicts_its_records_is_not_clean(tmp_path: Path, summary: str, note: str) -> None:
    result = _report_of(tmp_path, _event(), summary)
    assert result.returncode == 1, result.stdout
    assert note in result.stdout


def test_guarded_calls_that_protected_nothing_prove_nothing(tmp_path: Path) -> None:
    result = _report_of(tmp_path, _summary(protected=0, targets={TARGET: {"calls": 3, "protected": 0}}))
    assert result.returncode == 2, result.stdout
    assert "made 3 guarded calls that protected no tensor: nothing was checked" in result.stdout


def test_a_truncated_summary_is_no_proof(tmp_path: Path) -> None:
    line = _summary()
    result = _report_of(tmp_path, line[: len(line) // 2])  # the job died while writing it
    assert result.returncode == 2, result.stdout
    assert "wrote no summary record" in result.stdout and "skipped 1 malformed line" in result.stderr


def test_a_header_alone_is_no_proof(tmp_path: Path) -> None:
    result = _report_of(tmp_path)
    assert result.returncode == 2 and "wrote no summary record" in result.stdout


def test_hand_edited_fields_of_the_wrong_type_never_crash_the_report(tmp_path: Path) -> None:
    odd = _summary(writes=1, sites=[{"writes": "many", "first": "x", "paths": [1]}, 3], allowed="all",
                   problems="oops", events_cut="?", targets={TARGET: "x"})
    result = _report_of(tmp_path, odd)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "note: oops" in result.stdout
