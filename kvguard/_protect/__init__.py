"""The protected set: which memory belongs to which guarded entry, since when, and what it held.

`contract` is what the rooms above use of a set (`Protected`, and the `Capabilities` a kind's
set overrides); `protected` composes the plain set and `native` keeps it in C++; `tree` walks
a guarded object to its tensors with their paths, `frames` finds the user's frame behind an
op and `placements` the statement that placed a tensor, `records` reads what an entry keeps
of its tensor (spans, layout, digest) and `digest` fingerprints values. A kind's set: `saved`
is what autograd saved for backward (`guard_autograd`; with `saved_packs`, `saved_composed`,
`saved_savers`, `saved_bridge`), `weights` a model's parameters and buffers (`guard_module`;
with `weights_steps`, `weights_writers` and the rollout side's modules), `samples` what
datasets returned. Below the guard and the engines; imports only `_native`, reporting and
the leaves. `tree`, `frames` and `placements` import no torch (the pytest plugin uses them).
"""
