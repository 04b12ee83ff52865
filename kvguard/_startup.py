"""The name older `kvguard.pth` and `kvguard.start` lines call: `import kvguard._startup; activate()`.

`python -m kvguard install-pth` writes such a line into site-packages, where no installer
removes it, so it outlives upgrades; the activation itself is `kvguard._activate.startup`.
"""

from kvguard._activate.startup import activate as activate
