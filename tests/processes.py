"""What the tests that start processes share: a free port, Python run with kvguard settings, and
a copy of the source tree to build from."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional


def free_port() -> int:
    """A free TCP port on localhost, for gloo, torchrun and Ray processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_python(*args: object, cwd: Optional[Path] = None, timeout: int = 120,
               **settings: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in this environment with `settings` added to it (`KVGUARD="raise"`, ...)."""
    return subprocess.run([sys.executable, *map(str, args)], env={**os.environ, **settings}, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


ROOT = Path(__file__).resolve().parent.parent
# What a build leaves in a tree, and what runs write into it while the tests run
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so", "site",
                                     ".kvguard-cache", ".inductor-cache", ".pytest_cache", ".hypothesis", "reports")


def source_copy(dest: Path) -> Path:
    """A copy of this checkout's sources at `dest`, to build or install from. pip builds in the
    tree it is given (build/, egg-info, the C helper's .so): two builds of the checkout itself
    at once, on two xdist workers, race there, and a build changes what the running tests import."""
    shutil.copytree(ROOT, dest, ignore=_NOT_SOURCE)
    return dest
