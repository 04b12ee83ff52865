"""Put first on PYTHONPATH by `python -m kvguard run`: activate kvguard, then chain.

Any `sitecustomize` that was already on the path (a venv's, a cluster's) still runs.
"""

import os
import sys

try:
    import kvguard._startup

    kvguard._startup.activate()
except Exception as exc:  # noqa: BLE001
    sys.stderr.write(f"kvguard: not activated: {exc}\n")

_here = os.path.dirname(os.path.abspath(__file__))
_saved = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["sitecustomize"]
try:
    import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the next one on the path
except ImportError:
    pass
finally:
    sys.path[:] = _saved
