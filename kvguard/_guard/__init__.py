"""The guard: `guard()` and `Guard`, the `guarded` decorator and its call wrapper, intended writes.

`guard` applies the action, owns the report and runs the boundary checks; `autograd` is
`guard_autograd()`, a guard over what autograd saves; `module` is `guard_module()`, over a
model's weights; `calls` is the
one call wrapper that `guarded` and env targets share (plain, generator, coroutine and
async generator functions); `allow` is `allow=` and `kvguard.allow(reason)`; `handlers`
reads from the bytecode which handler will catch a `MutationError`. Imports the engines,
the protected set, reporting and the leaves; torch-free at import.
"""
