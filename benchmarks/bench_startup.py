"""What an installed kvguard costs at interpreter start-up, with KVGUARD unset and set.

Builds a wheel of this checkout and makes two fresh virtual environments that differ
only in whether that wheel (and so `kvguard.pth`) is installed; torch and the other
dependencies come from the current environment through a path file in both. Then it
times `python -c pass` in each, alternating runs, and prints medians side by side.

    python benchmarks/bench_startup.py [--runs 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_env(home: Path, wheel: Path | None) -> Path:
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    if wheel is not None:
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        "--ignore-installed", str(wheel)], check=True, capture_output=True)
    Path(site, "00-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after: pip must not see them
    return python


def time_start(python: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(out)],
                       check=True, capture_output=True)
        (wheel,) = out.glob("kvguard-*.whl")
        pythons = {"without kvguard": make_env(out / "bare", None), "with kvguard": make_env(out / "kv", wheel)}
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PYTHON"))}
        settings = {
            "KVGUARD unset": base,
            "KVGUARD=0": {**base, "KVGUARD": "0"},
            "KVGUARD=warn + target": {**base, "KVGUARD": "warn", "KVGUARD_TARGETS": "mod:fn(arg)"},
        }
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(2):  # warm the page cache
            for python in pythons.values():
                time_start(python, base)
        for _ in range(opts.runs):
            for setting, env in settings.items():
                for label, python in pythons.items():
                    times.setdefault((setting, label), []).append(time_start(python, env))
    print(f"python -c pass, median of {opts.runs} alternating runs (ms)")
    print(f"{'':24s} {'without kvguard':>16s} {'with kvguard':>14s} {'ratio':>7s}")
    for setting in settings:
        a = statistics.median(times[(setting, "without kvguard")]) * 1e3
        b = statistics.median(times[(setting, "with kvguard")]) * 1e3
        print(f"{setting:24s} {a:16.1f} {b:14.1f} {b / a:7.3f}")


if __name__ == "__main__":
    main()
