"""What kvguard has below Python: the C and C++ sources it builds, and the build of the write hook.

`csrc/write_hook.cpp` is the compiled engine's hook on `ADInplaceOrView` and also reads a
batch of tensors for the protected set's records, so it serves two rooms; it is built at
first use for the installed torch (`build`). `csrc/speedups.c` (the placement check and
list walk, lent to the hook through a capsule), `csrc/digest.c` (digests of CPU memory) and
`csrc/stores.c` (a dict watcher: stores heard as they are made, Python 3.12+) are optional
extensions built at install; every one has a Python fallback (for stores: the next look). The `.pyi`
files type them. Imports no room of kvguard's.
"""
