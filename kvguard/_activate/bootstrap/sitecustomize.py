"""Put first on PYTHONPATH by `python -m kvguard run`: activate kvguard, then chain.

Any `sitecustomize` that was already on the path (a venv's, a cluster's) still runs.
"""

import os
import sys


def _activate() -> None:
    """Switch kvguard on; a failure must not stop the job or the chained sitecustomize."""
    try:
        import kvguard._activate.startup

        kvguard._activate.startup.activate()
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"kvguard: not activated: {exc}\n")


def _chain() -> None:
    """Run the `sitecustomize` this file shadows, if any, as Python would have run it.

    It is looked up on sys.path without this directory, without touching sys.path (so
    what it adds there stays) or sys.modules (the import of this module pops its own
    entry when it finishes: removing it made Python print `Error in sitecustomize`).
    Its errors propagate to `site`, which reports them as it always does.
    """
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if isinstance(p, str) and os.path.abspath(p or ".") != here]
    spec = PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # what `import sitecustomize` finds afterwards
    spec.loader.exec_module(module)


_activate()
_chain()
