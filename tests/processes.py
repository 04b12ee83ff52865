"""What the tests that start processes share: a free port, and Python run with kvguard settings."""

from __future__ import annotations

import os
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
