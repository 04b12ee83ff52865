"""Run PyTorch's own test files plain and under ``KVGUARD=raise KVGUARD_TARGETS=autograd,weights``.

PyTorch's upstream repository is too large to fetch here; Ascend/pytorch carries its
test files (adapted to NPU devices and kept in step with upstream). This script:

  prepare SRC DEST   copies SRC/test (an extracted Ascend/pytorch ``test`` folder) to
                     DEST, adds a stand-in ``torch_npu`` package (no NPU: every NPU-only
                     test skips) and instantiates the device-type tests for the CPU
                     (Ascend instantiates them for ``privateuse1`` only)
  run DEST NAME FILE [pytest args]
                     runs ``pytest FILE`` in DEST twice, plain and switched, writing
                     DEST/NAME.plain.xml and DEST/NAME.switched.xml (junit)
  ids DEST FILE FIRST LAST OUT
                     writes the node ids FIRST to LAST (from 1, in collection order) of
                     `pytest FILE` in DEST to OUT, one a line: a chunk that `run DEST NAME
                     @OUT` runs in a process of its own (test_nn.py's 2,163 tests do not fit
                     one process's memory here)
  diff DEST NAME [SHARD,SHARD]
                     prints the figures and every test whose outcome differs (against
                     the switched runs of SHARDs, `run DEST SHARD FILE --switched -k ...`)

Nothing here is imported by kvguard or its tests; the fetched files stay out of the repo.

  git -C /work/.mirror/Ascend+pytorch/repo archive HEAD test | tar -x -C /tmp/ptt
  python tools/pytorch_tests.py prepare /tmp/ptt/test /tmp/ptrun
  python tools/pytorch_tests.py run /tmp/ptrun autograd test_autograd.py
  python tools/pytorch_tests.py diff /tmp/ptrun autograd
  python tools/pytorch_tests.py ids /tmp/ptrun test_nn.py 1013 1200 /tmp/nnA.txt
  python tools/pytorch_tests.py run /tmp/ptrun nnA @/tmp/nnA.txt
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

STAND_IN = {
    "torch_npu/__init__.py": (
        "import torch\n"
        "from . import npu, testing, profiler  # noqa: F401\n"
        "torch.npu = npu  # torch_npu registers torch.npu; here it says no NPU\n"
    ),
    "torch_npu/npu.py": (
        "def get_device_name(i=0):\n    return 'none'\n"
        "def is_available():\n    return False\n"
        "def device_count():\n    return 0\n"
        "def synchronize(*a, **k):\n    pass\n"
        "def is_bf16_supported():\n    return False\n"
    ),
    "torch_npu/profiler.py": (
        "import unittest\n"
        "def profile(*a, **k):\n    raise unittest.SkipTest('torch_npu stand-in: no NPU profiler')\n"
        "def tensorboard_trace_handler(*a, **k):\n    return None\n"
    ),
    "torch_npu/testing/__init__.py": "",
    # Each test's outcome as it ends (a run stopped early, or killed, keeps what it did).
    "ptt_record.py": (
        "import os\n"
        "def pytest_runtest_logreport(report):\n"
        "    if report.when == 'call' or report.outcome != 'passed':\n"
        "        state = 'xfailed' if hasattr(report, 'wasxfail') else report.outcome\n"
        "        msg = ''\n"
        "        if report.outcome == 'failed':\n"
        "            msg = str(getattr(report.longrepr, 'reprcrash', None) and report.longrepr.reprcrash.message or '')\n"
        "        with open(os.environ['PTT_RECORD'], 'a') as out:\n"
        "            out.write(report.nodeid + '\\t' + state + '\\t' + msg.splitlines()[0][:200] if msg else report.nodeid + '\\t' + state)\n"
        "            out.write('\\n')\n"
    ),
    "torch_npu/testing/common_distributed.py": (
        "import unittest\n"
        "def skipIfUnsupportMultiNPU(n):\n"
        "    return unittest.skip('torch_npu stand-in: no NPU')\n"
    ),
    "torch_npu/testing/common_utils.py": (
        "import unittest\n"
        "def SupportedDevices(devices):\n"
        "    return unittest.skip('torch_npu stand-in: no NPU')\n"
    ),
}

SWITCHED = {"KVGUARD": "raise", "KVGUARD_TARGETS": "autograd,weights"}


def prepare(src: str, dest: str) -> None:
    src_p, dest_p = Path(src), Path(dest)
    if dest_p.exists():
        shutil.rmtree(dest_p)
    shutil.copytree(src_p, dest_p, symlinks=True)
    for rel, text in STAND_IN.items():
        path = dest_p / "_stand_in" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    # Device-type tests: Ascend instantiates them only for privateuse1 (the NPU).
    for path in dest_p.rglob("*.py"):
        text = path.read_text()
        new = re.sub(r"only_for\s*=\s*['\"]privateuse1['\"]", "only_for='cpu'", text)
        if new != text:
            path.write_text(new)


def _env(switched: bool) -> dict:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("KVGUARD"):
            del env[k]
    if switched:
        env.update(SWITCHED)
    dest_stand_in = env.get("_PTT_STAND_IN", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (dest_stand_in, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTORCH_TEST_WITH_SLOW", "0")
    env["HYPOTHESIS_PROFILE"] = env.get("HYPOTHESIS_PROFILE", "")
    return env


def run(dest: str, name: str, file: str, extra: list[str], which: str = "both") -> None:
    dest_p = Path(dest).resolve()
    os.environ["_PTT_STAND_IN"] = str(dest_p / "_stand_in")
    modes = {"both": (False, True), "plain": (False,), "switched": (True,)}[which]
    for switched in modes:
        tag = "switched" if switched else "plain"
        cmd = [
            sys.executable, "-m", "pytest", file, "-p", "no:cacheprovider", "-q",
            "-o", "addopts=", "--junitxml", str(dest_p / f"{name}.{tag}.xml"), *extra,
        ]
        log = dest_p / f"{name}.{tag}.log"
        record = dest_p / f"{name}.{tag}.tsv"
        record.unlink(missing_ok=True)
        env = _env(switched)
        env["PTT_RECORD"] = str(record)
        cmd[3:3] = ["-p", "ptt_record"]
        with open(log, "w") as out:
            rc = subprocess.call(cmd, cwd=dest_p, env=env, stdout=out, stderr=subprocess.STDOUT)
        print(f"{name} {tag}: rc {rc}, log {log}")


def ids(dest: str, file: str, first: int, last: int, out: str) -> None:
    dest_p = Path(dest).resolve()
    os.environ["_PTT_STAND_IN"] = str(dest_p / "_stand_in")
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", file, "-p", "no:cacheprovider", "-q", "-o", "addopts=", "--collect-only"],
        cwd=dest_p, env=_env(False), capture_output=True, text=True).stdout
    nodes = [line for line in listed.splitlines() if "::" in line]
    chunk = nodes[first - 1:last]
    Path(out).write_text("".join(n + "\n" for n in chunk))
    print(f"{len(chunk)} of {len(nodes)} tests to {out}")


def outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """Outcome and first message line by test: from the junit file, else the per-test record."""
    res: dict[str, tuple[str, str]] = {}
    if path.exists():
        for case in ET.parse(path).getroot().iter("testcase"):
            module, _, cls = case.get("classname", "").rpartition(".")  # "nn.test_init.TestNNInit"
            key = f"{case.get('file') or module.replace('.', '/') + '.py'}::{cls}::{case.get('name')}"
            state, msg = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    state = {"failure": "failed", "error": "failed", "skipped": "skipped"}[child.tag]
                    msg = (child.get("message") or "").splitlines()[0][:200] if child.get("message") else ""
                    break
            res[key] = (state, msg)
        return res
    record = path.with_suffix(".tsv")
    for line in record.read_text().splitlines() if record.exists() else ():
        nodeid, state, *msg = line.split("\t")
        if state == "xfailed":
            state = "skipped"
        res[nodeid.replace("autograd/", "")] = (state, msg[0] if msg else "")
    return res


def diff(dest: str, name: str, shards: list[str]) -> None:
    """Plain `NAME` against switched `NAME` (or the switched runs of `shards`, each a `-k`
    part of the file: only the tests they ran are compared)."""
    d = Path(dest)
    plain = outcomes(d / f"{name}.plain.xml")
    sw: dict[str, tuple[str, str]] = {}
    for shard in shards or [name]:
        sw.update(outcomes(d / f"{shard}.switched.xml"))
    if shards or not (d / f"{name}.plain.xml").exists():  # a part, or runs stopped early: what both ran
        both = set(plain) & set(sw)
        plain = {k: v for k, v in plain.items() if k in both}
        sw = {k: v for k, v in sw.items() if k in both}
    keys = sorted(set(plain) | set(sw))
    counts: dict[str, int] = {}
    for k in keys:
        s = plain.get(k, ("absent", ""))[0]
        counts[s] = counts.get(s, 0) + 1
    same = [k for k in keys if plain.get(k, ("absent",))[0] == sw.get(k, ("absent",))[0]]
    changed = [k for k in keys if k not in same]
    print(f"{name}: {len(keys)} tests; plain {counts}; same outcome {len(same)}; changed {len(changed)}")
    for k in changed:
        p, s = plain.get(k, ("absent", "")), sw.get(k, ("absent", ""))
        print(f"  {k}: {p[0]} -> {s[0]}  {s[1] or p[1]}")


def main(argv: list[str]) -> None:
    cmd = argv[0]
    if cmd == "prepare":
        prepare(argv[1], argv[2])
    elif cmd == "run":
        which = "both"
        rest = argv[4:]
        if rest and rest[0] in ("--plain", "--switched"):
            which, rest = rest[0][2:], rest[1:]
        run(argv[1], argv[2], argv[3], rest, which)
    elif cmd == "ids":
        ids(argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5])
    elif cmd == "diff":
        diff(argv[1], argv[2], argv[3].split(",") if len(argv) > 3 else [])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
