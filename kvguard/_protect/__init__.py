"""The protected set: which memory belongs to which guarded entry, since when, and what it held.

`protected` composes it; `tree` walks a guarded object to its tensors with their paths,
`frames` finds the user's frame behind an op and the statement that placed a tensor,
`records` reads what an entry keeps of its tensor (spans, layout, digest) and `digest`
fingerprints values; `saved` is the set of what autograd saved for backward
(`guard_autograd`), `weights` a model's parameters and buffers (`guard_module`). Below the guard and the engines; imports only `_native`, reporting
and the leaves. `tree` and `frames` import no torch (the pytest plugin uses them).
"""
