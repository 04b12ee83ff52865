"""The one-line `kvguard.pth` and the PEP 829 `kvguard.start`, and installing them by hand.

The `.pth` line reads `os.environ` before importing anything and never raises, so an
installed kvguard costs nothing while `KVGUARD` is unset. Wheels ship both files;
editable installs get neither (PEP 660), hence `python -m kvguard install-pth`.
"""

from __future__ import annotations

import os
import sysconfig

PTH_NAME = "kvguard.pth"
START_NAME = "kvguard.start"
PTH_LINE = (
    "import os, sys; exec('try:\\n import kvguard._activate.startup as m; m.activate()\\n"
    "except Exception as e: sys.stderr.write(\"kvguard: not activated: %r\\\\n\" % (e,))')"
    " if os.environ.get('KVGUARD', '').strip() not in ('', '0') else None\n"
)
START_LINE = "kvguard._activate.startup:activate\n"


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def install(directory: str | None = None) -> str:
    """Write `kvguard.pth` into site-packages (or `directory`); returns its path."""
    path = os.path.join(directory or site_packages(), PTH_NAME)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(PTH_LINE)
    return path


def uninstall(directory: str | None = None) -> str | None:
    """Remove a `kvguard.pth` written by `install`; returns its path if there was one."""
    path = os.path.join(directory or site_packages(), PTH_NAME)
    if os.path.exists(path):
        os.remove(path)
        return path
    return None
