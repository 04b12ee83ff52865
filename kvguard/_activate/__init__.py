"""Activation: switching kvguard on with no code change, and in tests.

`startup` is env activation (called by `kvguard.pth`, `kvguard.start`, `kvguard run`'s
`bootstrap/sitecustomize.py` and `kvguard.start()`), with the exit summary; `importhook`
guards the `KVGUARD_TARGETS` functions as their modules are imported; `autograd` enters
the process's `guard_autograd` for `KVGUARD_TARGETS=autograd`, `weights` the weights guard
for `KVGUARD_TARGETS=weights` (`process_guards` ends their tracebacks at the user's line and leaves them at exit); `pth` writes the
start-up lines; `pytest_plugin` and `pytest_off` are the pytest entry points. The
settings themselves (`_config`), the presets (`_presets`) and ranks (`_ranks`) are
leaves every room reads. The top of the house: imports every room below it.
"""
