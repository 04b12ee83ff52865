"""Activation: switching kvguard on with no code change, and in tests.

`startup` is env activation (called by `kvguard.pth`, `kvguard.start`, `kvguard run`'s
`bootstrap/sitecustomize.py` and `kvguard.start()`), with the exit summary; `importhook`
guards the `KVGUARD_TARGETS` functions as their modules are imported; `process_kind` starts
and stops each process-wide kind its word names (`kvguard._kinds`: `autograd`, `data`), and
`weights` the `weights` kind its own way: the process's weights guard (`weights_guard`), at
each optimizer (the trainer's side) and each load (`weights_loads`, `load_points`: the rollout
engine's side), with the receive buffers a load reads from (`weights_receives`);
`process_guards` ends their tracebacks at the user's line and leaves them at exit; `pth` writes the
start-up lines; `pytest_plugin` and `pytest_off` are the pytest entry points. The
settings themselves (`_config`), the presets (`_presets`) and ranks (`_ranks`) are
leaves every room reads. The top of the house: imports every room below it.
"""
