"""The compiled write hook (`kvguard._native.write_hook`), raw, through `kvguard._native.build.load()`.

Without a compiler the module is skipped, except under CI (env `CI` set), where a hook that
does not build is a failure. The hook is installed once per session; each test leaves it
disabled with no callback, watch or intervals.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from kvguard._native import build as _build

ROOT = Path(__file__).resolve().parent.parent


class Refused(Exception):
    """What the test callbacks raise."""


@pytest.fixture(scope="session")
def write_hook_module() -> ModuleType:
    """The module, built once per session (installed by `only_this_hook`, per test module)."""
    module = _build.load()
    if module is None:
        if os.environ.get("CI"):
            pytest.fail(f"the compiled write hook did not build under CI: {_build.reason()}")
        pytest.skip(f"the compiled write hook is not available: {_build.reason()}")
    return module


@pytest.fixture(scope="module", autouse=True)
def only_this_hook() -> Iterator[None]:
    """These tests own the raw module: no engine's hook is installed before them or left after.

    kvguard's engines install one write hook at a time (`_choice.install_only`). A hook left
    under this one would change what "unguarded" means here, and removing it later would
    pull the kernels this one calls from under it. The hook is installed after that, once.
    """
    from kvguard._engine import choice as _choice

    install_only = getattr(_choice, "install_only", None)
    if install_only is not None:
        install_only(None)
    module = sys.modules.get("kvguard._native.write_hook")
    if module is not None:
        module.uninstall()
    yield
    module = sys.modules.get("kvguard._native.write_hook")
    if module is not None:
        _reset(module)
        module.uninstall()


def _reset(h: ModuleType) -> None:
    h.set_enabled(False)
    h.set_send_all(False)
    h.set_callback(None)
    h.set_watch(None)
    h.set_intervals([])
    h.set_identities([])


@pytest.fixture
def h(write_hook_module: ModuleType) -> Iterator[ModuleType]:
    """The module, installed and clean; left disabled with nothing set, whatever the test did."""
    write_hook_module.install()
    _reset(write_hook_module)
    try:
        yield write_hook_module
    finally:
        _reset(write_hook_module)
        write_hook_module.install()


class Recorder:
    """A callback that records `(op_name, written)` and optionally returns an `after`."""

    def __init__(self, after: Optional[Callable[[], object]] = None) -> None:
        self.calls: list[tuple[str, tuple[torch.Tensor, ...]]] = []
        self.after = after

    def __call__(self, op: str, written: tuple[torch.Tensor, ...]) -> Optional[Callable[[], object]]:
        self.calls.append((op, written))
        return self.after

    @property
    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]


def storage_interval(*tensors: torch.Tensor) -> list[tuple[int, int]]:
    spans = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                   for t in tensors)
    return spans


def protect(h: ModuleType, *tensors: torch.Tensor, callback: Callable[..., Any]) -> None:
    h.set_intervals(storage_interval(*tensors))
    h.set_callback(callback)
    h.set_enabled(True)


class unhooked:
    """Runs a block with the hook uninstalled (the unguarded baseline), then reinstalls it."""

    def __init__(self, h: ModuleType) -> None:
        self.h = h

    def __enter__(self) -> None:
        self.h.uninstall()

    def __exit__(self, *exc: object) -> None:
        self.h.install()


# ---- what gets reported ----------------------------------------------------------------


def test_install_is_idempotent_and_lists_the_writing_overloads(h: ModuleType) -> None:
    n = h.install()
    assert h.install() == n and h.installed()
    ops = h.hooked_ops()
    assert len(ops) == n > 1000
    for name in ("aten::mul_.Tensor", "aten::add.out", "aten::copy_.default", "aten::index_put_.default",
                 "aten::_foreach_mul_.Scalar", "aten::_fused_adamw_.default"):
        assert name in ops
    assert "aten::add.Tensor" not in ops  # writes nothing


def test_writes_schemas_do_not_declare_are_hooked_from_kvguards_tables(h: ModuleType) -> None:
    ops = h.hooked_ops()
    assert "aten::native_batch_norm.default" in ops and "c10d::allreduce_.default" in ops
    x = torch.randn(4, 3)
    rm, rv = torch.zeros(3), torch.ones(3)
    rec = Recorder()
    protect(h, rm, callback=rec)
    torch.native_batch_norm(x, None, None, rm, rv, False, 0.1, 1e-5)  # eval: no write
    assert rec.calls == []
    torch.native_batch_norm(x, None, None, rm, rv, True, 0.1, 1e-5)
    assert rec.ops == ["aten::native_batch_norm.default"]
    assert rec.calls[0][1][0] is rm and rec.calls[0][1][1] is rv
    h.uninstall()
    try:
        h.install(undeclared={}, c10d_names=())
        ops = h.hooked_ops()
        assert "aten::native_batch_norm.default" not in ops and "c10d::allreduce_.default" not in ops
        h.uninstall()
        h.install(undeclared={"aten::native_batch_norm": (["running_var"], None)}, c10d_names=["tensors"])
        h.set_intervals(storage_interval(rm, rv))
        rec.calls.clear()
        torch.native_batch_norm(x, None, None, rm, rv, False, 0.1, 1e-5)  # no condition now
        assert rec.ops == ["aten::native_batch_norm.default"]
        assert len(rec.calls[0][1]) == 1 and rec.calls[0][1][0] is rv
        assert "c10d::allreduce_.default" in h.hooked_ops()
        h.uninstall()
        with pytest.raises(TypeError):
            h.install(undeclared={"aten::native_batch_norm": "running_var"})
        assert not h.installed()
    finally:
        h.uninstall()
        h.install()


def test_in_place_hit_reports_the_op_and_the_tensor(h: ModuleType) -> None:
    x = torch.ones(8)
    rec = Recorder()
    protect(h, x, callback=rec)
    x.mul_(2)
    assert rec.ops == ["aten::mul_.Tensor"]
    assert rec.calls[0][1][0] is x
    x[2:4].zero_()  # a view shares the storage
    assert rec.ops[-1] == "aten::zero_.default" and rec.calls[-1][1][0]._base is x


def test_out_hit_reports_the_out_overload(h: ModuleType) -> None:
    x = torch.ones(8)
    rec = Recorder()
    protect(h, x, callback=rec)
    torch.add(torch.ones(8), 1, out=x)
    assert rec.ops == ["aten::add.out"] and rec.calls[0][1] == (x,)


def test_setitem_augmented_assignment_reports_once(h: ModuleType) -> None:
    k = torch.zeros(4, 3)
    rec = Recorder()
    protect(h, k, callback=rec)
    k[-1] += torch.ones(3)  # add_ on the view, then the view copied onto itself (not a write)
    assert rec.ops == ["aten::add_.Tensor"]
    rec.calls.clear()
    k[torch.tensor([0, 2])] += 1.0  # index (a copy), add_ on the copy, then index_put_ into k
    assert rec.ops == ["aten::index_put_.default"]
    assert rec.calls[0][1][0] is k
    assert k.sum().item() == 3 + 6


def test_miss_does_not_call_back(h: ModuleType) -> None:
    x, other = torch.ones(8), torch.ones(8)
    rec = Recorder()
    protect(h, x, callback=rec)
    other.add_(1)
    torch.mul(x, 2, out=other)  # reading x is not writing it
    y = x * 2 + x.sum()
    y.add_(1)
    assert rec.calls == []


def test_intervals_are_half_open_byte_ranges(h: ModuleType) -> None:
    x = torch.ones(8)
    start = x.untyped_storage().data_ptr()
    rec = Recorder()
    h.set_callback(rec)
    h.set_enabled(True)
    h.set_intervals([(start - 64, start)])  # ends where x begins
    x.add_(1)
    h.set_intervals([(start + 16, start + 17)])  # one byte inside x (32 bytes)
    x.add_(1)
    h.set_intervals([(1, 2), (start - 64, start), (start + 31, start + 40), (2**63, 2**64 - 1)])
    x.add_(1)
    assert rec.ops == ["aten::add_.Tensor"] * 2


def test_bad_intervals_are_refused(h: ModuleType) -> None:
    with pytest.raises(ValueError):
        h.set_intervals([(10, 20), (5, 8)])  # unsorted
    with pytest.raises(ValueError):
        h.set_intervals([(10, 20), (15, 30)])  # overlapping
    with pytest.raises(ValueError):
        h.set_intervals([(20, 10)])
    with pytest.raises(ValueError):
        h.set_intervals([(-1, 10)])
    with pytest.raises(ValueError):
        h.set_intervals([(0, 2**64)])
    with pytest.raises(TypeError):
        h.set_intervals([(1.0, 2)])
    with pytest.raises(TypeError):
        h.set_intervals([(1, 2, 3)])
    with pytest.raises(TypeError):
        h.set_intervals([5])
    with pytest.raises(TypeError):
        h.set_intervals(None)
    h.set_intervals([(1, 2), [2, 3], (3, 3), (5, 9)])  # touching, empty and list pairs are fine
    with pytest.raises(TypeError):
        h.set_callback(42)
    with pytest.raises(TypeError):
        h.set_watch("nope")


def test_raising_callback_stops_the_write(h: ModuleType) -> None:
    x = torch.arange(6.0)
    before, version = x.clone(), x._version

    def refuse(op: str, written: tuple[torch.Tensor, ...]) -> None:
        raise Refused(f"no {op}")

    protect(h, x, callback=refuse)
    with pytest.raises(Refused, match="no aten::mul_.Tensor"):
        x.mul_(2)
    with pytest.raises(Refused, match=r"no aten::add\.out"):
        torch.add(x, 1, out=x)
    with pytest.raises(Refused):
        torch._foreach_add_([torch.ones(2), x], 1.0)
    assert torch.equal(x, before) and x._version == version


class CountingError(Exception):
    """Counts how often its message is read."""

    reads = 0

    def __str__(self) -> str:
        CountingError.reads += 1
        return "counted"


def test_the_exception_is_the_callbacks_own_object_and_its_message_is_not_read(h: ModuleType) -> None:
    x = torch.ones(3, requires_grad=True)
    prot = torch.ones(3)
    raised: list[BaseException] = []

    def refuse(op: str, written: tuple[torch.Tensor, ...]) -> None:
        raised.append(CountingError())
        raise raised[-1]

    protect(h, prot, callback=refuse)
    CountingError.reads = 0
    with pytest.raises(CountingError) as info:
        prot.mul_(2)
    assert info.value is raised[-1] and CountingError.reads == 0
    x.register_hook(lambda g: prot.add_(1))
    with pytest.raises(CountingError) as info:
        (x * 2).sum().backward()  # (torch's engine reads the message of any hook's exception)
    assert info.value is raised[-1] and len(raised) == 2


def test_after_runs_once_the_write_is_done(h: ModuleType) -> None:
    x = torch.ones(4)
    seen: list[torch.Tensor] = []
    rec = Recorder(after=lambda: seen.append(x.clone()))
    protect(h, x, callback=rec)
    x.mul_(3)
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((4,), 3.0))

    def broken_after() -> None:
        raise Refused("after")

    h.set_callback(Recorder(after=broken_after))
    with pytest.raises(Refused, match="after"):
        x.add_(1)
    assert torch.equal(x, torch.full((4,), 4.0))  # the write happened before `after` raised


def test_after_true_when_torch_refuses_the_write(h: ModuleType) -> None:
    x = torch.ones(4)
    calls: list[tuple[object, ...]] = []

    def after(*args: object) -> None:
        calls.append(args)

    protect(h, x, callback=Recorder(after=after))
    with pytest.raises(RuntimeError, match="size of tensor"):
        x.add_(torch.ones(3))  # the op's own error comes out unchanged
    assert calls == [(True,)]

    def after_raises(*args: object) -> None:
        raise Refused(f"after{args}")

    h.set_callback(Recorder(after=after_raises))
    with pytest.raises(Refused, match=r"after\(True,\)") as info:
        x.add_(torch.ones(3))
    assert isinstance(info.value.__context__, RuntimeError)
    assert "size of tensor" in str(info.value.__context__)


def test_identities_make_a_tensor_a_candidate_wherever_its_memory_is(h: ModuleType) -> None:
    x, y = torch.empty(0), torch.ones(4)
    rec = Recorder()
    h.set_callback(rec)
    h.set_enabled(True)
    h.set_identities([y._cdata, x._cdata, y._cdata])  # any order, duplicates allowed
    torch.add(torch.ones(3), 1, out=x)  # resized: new memory, same tensor
    y.mul_(2)
    torch.ones(2).mul_(2)
    assert rec.ops == ["aten::add.out", "aten::mul_.Tensor"]
    h.set_intervals([(1, 2)])  # intervals and identities are set independently
    y.mul_(2)
    assert len(rec.calls) == 3
    with pytest.raises(TypeError):
        h.set_identities(["x"])
    with pytest.raises(ValueError):
        h.set_identities([-5])


def test_an_original_removed_from_under_the_hook_is_a_clear_error(h: ModuleType) -> None:
    below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.ADInplaceOrView)
    func = torch.ops.aten.sub_.Tensor
    h.uninstall()
    try:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            lib.impl("sub_.Tensor", lambda ks, *a, **k: func.redispatch(ks & below, *a, **k), "ADInplaceOrView",
                     with_keyset=True)
    finally:
        h.install()  # stacks on the Python kernel above
    lib._destroy()  # removed first: the kernel the hook calls is gone
    x = torch.ones(2)
    with pytest.raises(RuntimeError, match="kvguard write hook: .* aten::sub_.Tensor was removed"):
        x.sub_(1)
    h.uninstall()
    h.install()
    x.sub_(1)
    assert torch.equal(x, torch.zeros(2)) and x._version == 1


def test_a_non_callable_result_is_a_type_error_before_the_write(h: ModuleType) -> None:
    x = torch.ones(4)
    protect(h, x, callback=lambda op, written: 42)
    with pytest.raises(TypeError, match="expected None or a callable"):
        x.add_(1)
    assert torch.equal(x, torch.ones(4))


def test_foreach_reports_once_with_every_written_tensor(h: ModuleType) -> None:
    a, b, c = torch.ones(2), torch.ones(3), torch.ones(4)
    rec = Recorder()
    protect(h, b, callback=rec)
    torch._foreach_mul_([a, b, c], 2.0)  # the CPU slow path runs mul_ per tensor: not reported again
    assert rec.ops == ["aten::_foreach_mul_.Scalar"]
    assert [t is u for t, u in zip(rec.calls[0][1], (a, b, c))] == [True, True, True]


def test_writes_inside_the_callback_are_not_judged(h: ModuleType) -> None:
    x = torch.ones(4)
    rec = Recorder()

    def callback(op: str, written: tuple[torch.Tensor, ...]) -> None:
        rec(op, written)
        x.add_(100)  # a write to the protected tensor from the callback itself

    protect(h, x, callback=callback)
    x.mul_(2)
    assert rec.ops == ["aten::mul_.Tensor"]
    assert torch.equal(x, torch.full((4,), 202.0))


def test_send_all_reports_every_outermost_write(h: ModuleType) -> None:
    rec = Recorder()
    h.set_callback(rec)
    h.set_send_all(True)
    h.set_enabled(True)
    t = torch.ones(3)
    t.add_(1)
    torch.zeros(2).fill_(3)
    _ = t + 1
    assert rec.ops == ["aten::add_.Tensor", "aten::fill_.Scalar"]


def test_tensors_without_readable_memory_go_to_python(h: ModuleType) -> None:
    rec = Recorder()
    h.set_callback(rec)
    h.set_enabled(True)  # no intervals at all
    m = torch.empty(4, device="meta")
    m.add_(1)
    s = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,),
                                check_invariants=True)
    s.mul_(2)
    torch.ones(2).add_(1)  # ordinary memory, outside every interval
    assert rec.ops == ["aten::add_.Tensor", "aten::mul_.Tensor"]
    assert rec.calls[0][1][0] is m and rec.calls[1][1][0] is s


def test_disabled_or_without_callback_nothing_is_called(h: ModuleType) -> None:
    x = torch.ones(4)
    rec = Recorder()
    h.set_intervals(storage_interval(x))
    h.set_callback(rec)
    x.add_(1)  # installed, not enabled
    h.set_enabled(True)
    h.set_callback(None)
    x.add_(1)  # enabled, no callback
    assert rec.calls == [] and h.enabled()


# ---- watch and the write counter -------------------------------------------------------


def test_watch_runs_per_writing_op_and_not_for_reads(h: ModuleType) -> None:
    count = [0]

    def watch() -> None:
        count[0] += 1

    x = torch.ones(100)
    h.set_watch(watch)
    h.set_enabled(True)
    start = h.writes()
    y = x * 2 + x.sum()
    _ = y.mean(), x[3], x.view(10, 10).t()
    assert count[0] == 0 and h.writes() == start
    x.add_(1)
    torch.mul(x, 2, out=y)
    torch._foreach_add_([x, y], 1.0)  # one outermost op
    assert count[0] == 3 and h.writes() - start == 3
    h.set_enabled(False)
    x.add_(1)
    assert count[0] == 3 and h.writes() - start == 3


def test_watch_exception_stops_the_write(h: ModuleType) -> None:
    def watch() -> None:
        raise Refused("watch")

    x = torch.ones(3)
    h.set_watch(watch)
    h.set_enabled(True)
    with pytest.raises(Refused, match="watch"):
        x.add_(1)
    assert torch.equal(x, torch.ones(3)) and x._version == 0


def test_watch_with_snapshots_runs_only_when_a_container_changed(h: ModuleType) -> None:
    from kvguard._native import speedups as _speedups  # the check the hook borrows

    count = [0]

    def watch() -> None:
        count[0] += 1

    d: dict[str, object] = {"a": torch.ones(1)}
    lst = [torch.ones(1)]
    snapshots = [((d, lst), (*d.values(), *lst))]
    x = torch.ones(3)
    h.set_watch(watch, snapshots)
    h.set_enabled(True)
    x.add_(1)
    x.mul_(2)
    assert count[0] == 0 and _speedups.same_values(*snapshots[0])
    lst.append(torch.ones(1))  # a placement: the watch runs before every write until told again
    x.add_(1)
    x.add_(1)
    assert count[0] == 2
    h.set_watch(watch, [((d, lst), (*d.values(), *lst))])
    x.add_(1)
    assert count[0] == 2
    d["a"] = torch.zeros(1)
    x.add_(1)
    assert count[0] == 3
    h.set_watch(watch, [((1,), ())])  # not lists and dicts
    x.add_(1)  # a snapshot the check refuses: the watch decides
    assert count[0] == 4


def test_set_watch_refuses_malformed_snapshots(h: ModuleType) -> None:
    for bad in ([1], [(1, 2)], [((), ())[0:1]], "no"):
        with pytest.raises(TypeError):
            h.set_watch(lambda: None, bad)
    with pytest.raises(TypeError):
        h.set_watch("nope", [])


@pytest.mark.parametrize("seed", range(20))
def test_add_protected_merges_like_merge_intervals(h: ModuleType, seed: int) -> None:
    """Intervals published whole, then added piecemeal, in any order, protect exactly what one
    merged set would, here and in the Python twin."""
    import random

    from kvguard._protect import geometry as _geometry
    from kvguard._engine import kernels as _kernels

    rng = random.Random(seed)
    buffer = bytearray(4096)
    lo = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    first = [(lo + a, lo + a + rng.randint(1, 64)) for a in rng.sample(range(0, 3900), 12)]
    more = [(lo + a, lo + a + rng.randint(0, 64)) for a in rng.sample(range(0, 3900), rng.randint(1, 8))]
    want = _geometry.merge_intervals(first + [iv for iv in more if iv[0] < iv[1]])
    h.add_protected([(lo, lo + 4096)], [], True)  # replaced below, as a whole
    h.add_protected(first[::-1], [5], True)
    h.add_protected(more, [7, 3])
    _kernels.add_protected([(lo, lo + 4096)], [], True)
    _kernels.add_protected(first[::-1], [5], True)
    _kernels.add_protected(more, [])
    assert list(zip(*_kernels._state.intervals)) == want
    recorder = Recorder()
    h.set_callback(recorder)
    h.set_enabled(True)
    for offset in rng.sample(range(0, 4000), 60):
        recorder.calls.clear()  # a tensor whose storage is that one byte: the hook compares storages
        torch.frombuffer(memoryview(buffer)[offset:offset + 1], dtype=torch.uint8).add_(1)
        inside = any(a <= lo + offset < b for a, b in want)
        assert bool(recorder.calls) is inside, (offset, want)


# ---- same behaviour as unguarded ------------------------------------------------------


def _versions() -> list[int]:
    a, b, c = torch.ones(3), torch.ones(3), torch.ones(3)
    a.add_(1)
    a.mul_(2)
    torch.add(b, 1, out=a)
    torch._foreach_add_([b, c], 1.0)
    torch._foreach_add_([b], [c])
    v = a[1:]
    v.sub_(1)
    return [a._version, b._version, c._version, v._version]


def test_version_counters_match_unguarded(h: ModuleType) -> None:
    with unhooked(h):
        expected = _versions()
    assert _versions() == expected  # installed, disabled
    rec = Recorder()
    h.set_send_all(True)
    h.set_callback(rec)
    h.set_enabled(True)
    assert _versions() == expected  # every write goes through the callback
    assert len(rec.calls) == 6
    assert expected == [4, 2, 1, 4]  # the foreach bumps are all there


def _adamw_run(**options: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **options)
    data = torch.randn(32, 8)
    for _ in range(3):
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()] + [
        s.clone() for st in opt.state.values() for s in st.values()]


@pytest.mark.parametrize("options", [{"foreach": True}, {"fused": True}, {"foreach": False}],
                         ids=["foreach", "fused", "for-loop"])
def test_adamw_is_bit_identical(h: ModuleType, options: dict[str, bool]) -> None:
    with unhooked(h):
        expected = _adamw_run(**options)
    assert all(torch.equal(a, b) for a, b in zip(_adamw_run(**options), expected))
    rec = Recorder(after=lambda: None)
    h.set_send_all(True)
    h.set_callback(rec)
    h.set_enabled(True)
    got = _adamw_run(**options)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert rec.calls


def _inplace_error() -> str:
    a = torch.ones(3, requires_grad=True)
    b = a.exp()
    c = b.sum()
    b.add_(1)
    with pytest.raises(RuntimeError) as info:
        c.backward()
    return str(info.value)


def test_autograd_inplace_error_matches_unguarded(h: ModuleType) -> None:
    with unhooked(h):
        expected = _inplace_error()
    assert "modified by an inplace operation" in expected
    assert _inplace_error() == expected
    h.set_send_all(True)
    h.set_callback(Recorder())
    h.set_enabled(True)
    assert _inplace_error() == expected


def test_gradients_through_view_and_in_place_match(h: ModuleType) -> None:
    def run() -> torch.Tensor:
        w = torch.arange(6.0, requires_grad=True)
        y = w * 1.5
        y[1:4].mul_(w[:3])
        y.sum().backward()
        assert w.grad is not None
        return w.grad

    with unhooked(h):
        expected = run()
    h.set_send_all(True)
    h.set_callback(Recorder())
    h.set_enabled(True)
    assert torch.equal(run(), expected)


# ---- where the callback runs, and where its exception comes out ---------------------


def test_a_write_from_another_thread_reaches_the_callback(h: ModuleType) -> None:
    x = torch.ones(4)
    threads: list[int] = []

    def callback(op: str, written: tuple[torch.Tensor, ...]) -> None:
        threads.append(threading.get_ident())
        if op == "aten::mul_.Tensor":
            raise Refused("thread")

    protect(h, x, callback=callback)
    errors: list[BaseException] = []

    def worker() -> None:
        x.add_(1)
        try:
            x.mul_(5)
        except Refused as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(threads) == 2 and threads[0] == t.ident != threading.get_ident()
    assert len(errors) == 1 and torch.equal(x, torch.full((4,), 2.0))


def test_exception_comes_out_of_backward(h: ModuleType) -> None:
    prot = torch.zeros(3)

    def refuse(op: str, written: tuple[torch.Tensor, ...]) -> None:
        raise Refused(op)

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            prot.add_(1)
            return grad * 2

    w = torch.ones(3, requires_grad=True)
    protect(h, prot, callback=refuse)
    with pytest.raises(Refused, match="aten::add_.Tensor"):
        Double.apply(w).sum().backward()

    v = torch.ones(3, requires_grad=True)
    v.register_hook(lambda g: prot.mul_(2))
    with pytest.raises(Refused, match="aten::mul_.Tensor"):
        (v * 3).sum().backward()
    assert torch.equal(prot, torch.zeros(3)) and prot._version == 0


@pytest.mark.parametrize("options", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_exception_comes_out_of_optimizer_step(h: ModuleType, options: dict[str, bool]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, **options)
    model(torch.randn(3, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    ops: list[str] = []

    def refuse(op: str, written: tuple[torch.Tensor, ...]) -> None:
        ops.append(op)
        raise Refused(op)

    protect(h, *model.parameters(), callback=refuse)
    with pytest.raises(Refused):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert ops == (["aten::_foreach_mul_.Scalar"] if "foreach" in options else ["aten::_fused_adamw_.default"])


def test_a_custom_op_registered_before_install_is_hooked_as_itself(h: ModuleType) -> None:
    h.uninstall()
    try:
        @torch.library.custom_op("kvguard_test::bump", mutates_args={"x"})
        def bump(x: torch.Tensor) -> None:
            x.add_(1)
    finally:
        h.install()
    assert "kvguard_test::bump.default" in h.hooked_ops()
    with unhooked(h):
        x = torch.zeros(3)
        bump(x)
        expected_version = x._version
    x = torch.zeros(3)
    rec = Recorder()
    protect(h, x, callback=rec)
    bump(x)
    assert rec.ops == ["kvguard_test::bump.default"]  # the inner add_ is not judged again
    assert torch.equal(x, torch.ones(3)) and x._version == expected_version


def test_a_custom_op_registered_after_install_is_seen_at_its_inner_ops(h: ModuleType) -> None:
    @torch.library.custom_op("kvguard_test::late_bump", mutates_args={"x"})
    def late_bump(x: torch.Tensor) -> None:
        x.add_(1)

    assert "kvguard_test::late_bump.default" not in h.hooked_ops()
    x = torch.zeros(3)
    rec = Recorder()
    protect(h, x, callback=rec)
    late_bump(x)
    assert rec.ops == ["aten::add_.Tensor"]


def test_uninstall_restores_the_original_kernels(h: ModuleType) -> None:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("aten::_foreach_mul_.Scalar", "ADInplaceOrView")  # ours, where there was none
    h.uninstall()
    try:
        assert not h.installed() and h.hooked_ops() == []
        torch._C._dispatch_check_all_invariants()
        assert not has("aten::_foreach_mul_.Scalar", "ADInplaceOrView")
        assert has("aten::mul_.Tensor", "ADInplaceOrView")
        x = torch.ones(3)
        rec = Recorder()
        protect(h, x, callback=rec)
        h.set_send_all(True)
        x.mul_(2)
        torch._foreach_mul_([x], 2.0)
        assert rec.calls == [] and x._version == 2
    finally:
        h.install()
    torch._C._dispatch_check_all_invariants()


# ---- the build ------------------------------------------------------------------------


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def test_build_without_a_compiler_returns_none_with_a_reason(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        from kvguard._native import build as _build
        m = _build.load()
        print(m is None)
        print(_build.reason())
        print(_build.build())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_child_env(CXX="/nonexistent/c++", KVGUARD_CACHE_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "True"
    assert "compiler" in lines[1] and "CXX" in lines[1]
    assert lines[2].startswith("(False, ") and "compiler" in lines[2]
    assert "building" not in proc.stderr
    assert not list(tmp_path.rglob("*.so"))


def test_two_processes_building_together_build_once_and_both_load(
        write_hook_module: ModuleType, tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import torch
        from kvguard._native import build as _build
        m = _build.load()
        print(_build.reason() if m is None else m.install() > 1000)
    """)
    # A compiler that takes 3 s and writes the module this session built: the lock, the cache
    # and loading are what is tested here; compiling the source is (CI builds it from scratch).
    fake = tmp_path / "slow-cxx"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        while [ $# -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done
        sleep 3 && cp {write_hook_module.__file__} "$out"
    """))
    fake.chmod(0o755)
    env = _child_env(KVGUARD_CACHE_DIR=str(tmp_path / "cache"), CXX=str(fake))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert [out.strip() for out, _ in results] == ["True", "True"], results
    assert sum(err.count("kvguard: building the compiled write hook") for _, err in results) == 1
    assert len(list((tmp_path / "cache").rglob("write_hook*.so"))) == 1
    assert not list(tmp_path.rglob("*.tmp*")) and not list(tmp_path.rglob("failed"))


def test_a_failed_build_is_remembered(write_hook_module: ModuleType, tmp_path: Path) -> None:
    code = textwrap.dedent("""
        from kvguard._native import build as _build
        print(_build.load() is None)
        print(_build.reason())
    """)
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'error: simulated failure' >&2\nexit 1\n")
    broken.chmod(0o755)
    cache = tmp_path / "cache"
    env = _child_env(CXX=str(broken), KVGUARD_CACHE_DIR=str(cache))
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert first.stdout.splitlines()[0] == "True", first
    assert first.stdout.splitlines()[1].startswith("the compiler failed: error: simulated failure; "), first
    logs = list(cache.rglob("build.log"))
    assert len(logs) == 1 and "simulated failure" in logs[0].read_text()
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "KVGUARD_REBUILD=1" in second.stdout and "building" not in second.stderr, second
    third = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**env, "KVGUARD_REBUILD": "1"})
    assert "building" in third.stderr and "the compiler failed" in third.stdout, third


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def test_the_compiler_gets_the_cxx_standard_torch_was_built_as(write_hook_module: ModuleType,
                                                               tmp_path: Path) -> None:
    # torch 2.14's headers need C++20 (std::strong_ordering in c10/util/intrusive_ptr.h); a fixed
    # -std=c++17 made every build there fail and every guard fall back to a slower engine.
    standard = _build.cxx_standard()
    shown = torch.__config__.show()
    assert standard in ("c++17", "c++20", "c++23", "c++26"), standard
    if "C++ Version: 2020" in shown:
        assert standard == "c++20"
    if _torch_release() >= (2, 14):
        assert standard != "c++17", shown
    argv = tmp_path / "argv"
    fake = tmp_path / "recording-cxx"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        printf '%s\\n' "$@" >> {argv}
        while [ $# -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done
        cp {write_hook_module.__file__} "$out"
    """))
    fake.chmod(0o755)
    code = "from kvguard._native import build as b; print(b.build(force=True))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_child_env(CXX=str(fake), KVGUARD_CACHE_DIR=str(tmp_path / "cache")))
    assert proc.stdout.startswith("(True, "), (proc.stdout, proc.stderr)
    passed = argv.read_text().splitlines()
    assert [a for a in passed if a.startswith("-std=")] == [f"-std={standard}"], passed


def test_a_compiler_without_torchs_standard_builds_as_cxx17(write_hook_module: ModuleType, tmp_path: Path) -> None:
    standard = _build.cxx_standard()
    if standard == "c++17":
        pytest.skip(f"torch {torch.__version__} was built as C++17: there is nothing older to fall back to")
    # As g++ 9 answers -std=c++20: the option refused before any code is read.
    fake = tmp_path / "old-cxx"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for a in "$@"; do
          [ "$a" = -std={standard} ] && echo "old-cxx: error: unrecognized command-line option '$a'" >&2 && exit 1
        done
        while [ $# -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done
        cp {write_hook_module.__file__} "$out"
    """))
    fake.chmod(0o755)
    code = "from kvguard._native import build as b; print(b.load() is not None, b.reason())"
    env = _child_env(CXX=str(fake), KVGUARD_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.stdout.startswith("True loaded from "), (proc.stdout, proc.stderr)
    assert proc.stderr.count("kvguard: building") == 1 and "kvguard: built" in proc.stderr, proc.stderr
    # When C++17 fails too (torch 2.14's headers), the one line says both.
    fake.write_text(fake.read_text().replace("cp ", "echo 'x.h:1:1: error: no strong_ordering' >&2; exit 1; cp "))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**env, "KVGUARD_REBUILD": "1"})
    assert proc.stdout.startswith("False the compiler failed: x.h:1:1: error: no strong_ordering "
                                  f"(torch {torch.__version__} was built as {standard.upper()}, which this "
                                  f"compiler does not support: {fake}); the whole output is in "), proc.stdout
    assert proc.stdout.count("\n") == 1
