"""The README in order: the demo's wheel install, then the test command's editable install
in the same environment, then the env-var section's own commands, exactly as written.

One fresh venv gets `pip install .` and then `pip install -e .` (the two "Try it"
commands, without re-downloading torch: dependencies come from this environment through
a path file). The env-var example must then guard the job, activated only by `KVGUARD*`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from processes import source_copy

ROOT = Path(__file__).resolve().parent.parent


def _readme_block(after: str) -> str:
    """The first ```bash block after the line containing `after`."""
    text = (ROOT / "README.md").read_text()
    start = text.index(after)
    match = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert match, f"no bash block after {after!r}"
    return match.group(1)


def test_demo_then_tests_then_env_var_section(tmp_path: Path) -> None:
    home = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    clone = source_copy(tmp_path / "clone")  # pip builds in the tree: not in the one the tests import from
    subprocess.run([*pip, str(clone)], check=True, capture_output=True, cwd=tmp_path)  # the demo command's
    subprocess.run([*pip, "-e", str(clone)], check=True, capture_output=True, cwd=tmp_path)  # the test command's
    (site / "00-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    assert (site / "kvguard.pth").exists(), "the editable install removed the wheel's kvguard.pth"

    block = _readme_block("`examples/unchanged_job/` is a tiny RL job")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{home / 'bin'}{os.pathsep}{env['PATH']}"  # `. .venv/bin/activate`
    # The block's `cd examples/unchanged_job` and `reports` directory, in a copy of the example
    # of this test's own: other tests (in parallel under xdist) run the same job.
    shutil.copytree(ROOT / "examples" / "unchanged_job", tmp_path / "examples" / "unchanged_job",
                    ignore=shutil.ignore_patterns("__pycache__", "reports"))
    result = subprocess.run(["bash", "-c", "set -e\n" + block], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert "rollout_data['kl'][0] was modified in place by aten.mul_.Tensor" in result.stderr, result.stderr
    assert "kvguard: trainer_loss:compute_advantages_and_returns(rollout_data): 2 guarded calls" in result.stderr
    assert "rollout_data['kl'][0]" in result.stdout, result.stdout  # `kvguard report reports`: the table


def _slug(heading: str) -> str:
    """The anchor mkdocs (and GitHub) give a heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def test_readme_is_short_and_links_only_to_what_exists() -> None:
    """The README is the way in (at most 200 lines); the docs are the reference. Each relative
    link names a file of the repository, and an anchor into a page names one of its headings."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines"
    assert "shared/notes" not in text
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith("docs/") for link in links), "the README links into the docs"
    for link in links:
        assert not link.startswith(("http://", "https://", "/")), f"README links outside the repository: {link}"
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path} has no heading for #{anchor}"


def test_the_autograd_quick_start_prints_what_the_readme_shows(tmp_path: Path) -> None:
    """The README's `guard_autograd` example, run as the file it names, stops the write with
    exactly the lines the README shows under it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index('## When backward says "modified by an inplace operation"'):]
    code, shown = re.findall(r"```(?:python|text)?\n(.*?)```", section, re.S)[:2]
    assert code.startswith("# quick.py\n")
    (tmp_path / "quick.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD") or k == "KVGUARD_CACHE_DIR"}
    result = subprocess.run([sys.executable, "quick.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1
    printed = result.stderr.splitlines()
    for line in shown.strip().splitlines():
        assert line in printed, f"{line!r} not in:\n{result.stderr}"
