"""Activation: switching kvguard on with no code change, and in tests.

`startup` is env activation (called by `kvguard.pth`, `kvguard.start`, `kvguard run`'s
`bootstrap/sitecustomize.py` and `kvguard.start()`), with the exit summary; `importhook`
guards the `KVGUARD_TARGETS` functions as their modules are imported; `autograd` enters
the process's `guard_autograd` for `KVGUARD_TARGETS=autograd`, `weights` the weights guard
for `KVGUARD_TARGETS=weights` (`tracebacks` ends their tracebacks at the user's line); `pth` writes the
start-up lines; `pytest_plugin` and `pytest_off` are the pytest entry points. The
settings themselves (`_config`), the presets (`_presets`) and ranks (`_ranks`) are
leaves every room reads. The top of the house: imports every room below it.
"""
