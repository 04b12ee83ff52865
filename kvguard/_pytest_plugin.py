"""The pytest plugin under the module name that installs made before the rooms (0.2) give
pytest (their entry point metadata names it); the plugin is `kvguard._activate.pytest_plugin`."""

from kvguard._activate.pytest_plugin import *  # noqa: F403 - every hook and fixture, as pytest finds them
