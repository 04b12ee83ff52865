"""Detection engines: what sees a writing op, and the judge that turns it into events.

`choice` picks the engine (`KVGUARD_ENGINE`); `hooks` holds what the write-hook engines
share (the active guards, their protected memory, the callback), with the compiled hook
(`kvguard._native`) and `kernels`, its Python twin, as the two `backend.Backend`s; `mode`
is the `TorchDispatchMode` fallback; `judge` is the one place that turns a write into
events, and `diff` says before -> after. Imports the protected set, `_native`, reporting
and the leaves; every private torch API it needs goes through `kvguard._torch`.
"""
