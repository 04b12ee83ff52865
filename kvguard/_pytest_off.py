"""The second pytest entry point under the module name older installs give pytest; the
plugin is `kvguard._activate.pytest_off`."""

from kvguard._activate.pytest_off import *  # noqa: F403 - every hook and fixture, as pytest finds them
