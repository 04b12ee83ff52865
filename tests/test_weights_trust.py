"""Issue 26's weights items: no blind stretch, no false alarm, correct code unchanged.

Env activation is tested in fresh interpreters (`processes.run_python`, and pytest run in a
subprocess, whose capture must not hide what kvguard says).
"""

from __future__ import annotations

import gc
import textwrap
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from processes import run_python

import kvguard

# -- 1. the search for an optimizer's modules, from frames whose `self` has no `__dict__` ------------

SLOTTED = textwrap.dedent("""
    import torch

    class Slotted:                      # the issue's repro
        __slots__ = ("a",)
        def train(self):
            m = torch.nn.Linear(3, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m(torch.randn(4, 3)).sum().backward(); opt.step()
            with torch.no_grad(): m.weight.add_(1)

    class Holder:                       # the model in a slot: named as the code names it
        __slots__ = ("model", "opt")
        def __init__(self):
            self.model = torch.nn.Sequential(torch.nn.Linear(3, 2))
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        def stray(self):
            with torch.no_grad(): self.model[0].bias.mul_(2)

    class Hostile:                      # every attribute read raises
        def __getattribute__(self, name):
            raise RuntimeError("no attribute for you")
        def train(self):
            m = torch.nn.Linear(3, 2); opt = torch.optim.Adam(m.parameters())
            with torch.no_grad(): m.bias.zero_()

    class Loader:                       # load_state_dict from a frame without __dict__
        __slots__ = ()
        def load(self, sd):
            ref = torch.nn.Linear(3, 2); ref.load_state_dict(sd)
            ref.weight.data.mul_(0.5)

    def unfreeze():                     # a group added later (an adapter): watched from then on
        model = torch.nn.Linear(3, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        adapter = torch.nn.Linear(4, 2)
        opt.add_param_group({"params": adapter.parameters(), "lr": 1e-3})
        adapter(model(torch.randn(5, 3))).sum().backward(); opt.step()
        adapter.weight.detach().numpy()[0, 0] = 9.0
        opt.step()                      # finds the numpy write before absorbing it
        with torch.no_grad(): adapter.bias.add_(1)

    def freed():                        # PyTorch's test_no_cyclic_references, with an LR scheduler too
        import gc, weakref
        model = torch.nn.Linear(3, 2)
        gc.disable()
        for kind in (torch.optim.SGD, torch.optim.AdamW):
            opt = kind(model.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
            model(torch.randn(4, 3)).sum().backward(); opt.step(); sched.step()
            ref = weakref.ref(opt)
            del opt, sched
            print(kind.__name__, "freed" if ref() is None else "alive")
        gc.enable()

    def wrapped():                      # ZeroRedundancyOptimizer's shape: its step() steps an inner optimizer
        model = torch.nn.Linear(3, 2)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)

        class Wrapper(torch.optim.Optimizer):
            def __init__(self):
                super().__init__(model.parameters(), {})
            def step(self, closure=None):
                inner.step()

        outer = Wrapper()
        model(torch.randn(4, 3)).sum().backward(); outer.step()  # one optimizer step, not two

    Slotted().train()
    Holder().stray()
    unfreeze()
    freed()
    wrapped()
    Hostile.train(object.__new__(Hostile))
    Loader().load(torch.nn.Linear(3, 2).state_dict())
    print("done")
""")


def test_frames_without_dict_are_searched_under_the_env_switch(tmp_path: Path) -> None:
    script = tmp_path / "slotted.py"
    script.write_text(SLOTTED)
    result = run_python(script, cwd=tmp_path, KVGUARD="warn", KVGUARD_TARGETS="weights")
    assert result.returncode == 0 and "done" in result.stdout, result.stderr
    assert "SGD freed" in result.stdout and "AdamW freed" in result.stdout
    err = result.stderr
    assert "cannot watch" not in err
    for headline in ("m.weight was modified in place by aten.add_.Tensor at slotted.py:9",
                     "self.model.0.bias was modified in place by aten.mul_.Tensor at slotted.py:17",
                     "m.bias was modified in place by aten.zero_.default at slotted.py:24",
                     "ref.weight was modified in place by aten.mul_.Tensor at slotted.py:30",
                     "slotted.py:39 (no dispatched op): 1 write to adapter.weight",
                     "adapter.bias was modified in place by aten.add_.Tensor at slotted.py:40"):
        assert headline in err, err
    assert "weights: 16 parameters and buffers watched over 6 optimizer steps, 6 writes at 6 sites" in err


PYTEST_INNER = textwrap.dedent("""
    import torch
    import kvguard._activate.weights as activation

    def train(bug):
        m = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.randn(4, 3)).sum().backward()
        opt.step()
        if bug:
            with torch.no_grad():
                m.weight.add_(1)

    def test_made_under_pytest():       # pluggy's HookCaller (slots) is among the caller frames
        train(bug=True)

    def test_a_failure_to_watch_is_said(monkeypatch):
        def fail(*args):
            raise RuntimeError("simulated failure")
        monkeypatch.setattr(activation, "_holders", fail)
        train(bug=False)
""")


def test_under_pytest_the_optimizer_is_watched_and_a_failure_is_never_hidden(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(PYTEST_INNER)
    result = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "test_inner.py",
                        cwd=tmp_path, KVGUARD="warn", KVGUARD_TARGETS="weights")
    assert result.returncode == 0, result.stdout + result.stderr
    err = result.stderr.splitlines()
    # pytest captured the test's stderr (fd 2 too) and the test passed: the line is on the process's own stderr
    assert ("kvguard: KVGUARD_TARGETS=weights cannot watch SGD made at test_inner.py:7 (RuntimeError: simulated "
            "failure); its weights are not protected") in err
    assert "kvguard: weights: 2 parameters and buffers watched over 1 optimizer step, 1 write at 1 site" in err
    assert "  test_inner.py:12 aten.add_.Tensor: 1 write to m.weight (first: m.weight, after optimizer step 1)" in err
    assert ("kvguard: weights: 1 optimizer or module could not be watched, so their weights were not protected: "
            "SGD made at test_inner.py:7") in err
    assert not any("no optimizer was made" in line for line in err)


def test_attributes_of_slotted_and_hostile_objects() -> None:
    from kvguard._activate.weights import _attributes

    class Base:
        __slots__ = ("a", "_Base__hidden")

    class Slots(Base):
        __slots__ = "b"

    s = Slots()
    s.a, s.b = 1, 2  # `_Base__hidden` left empty: skipped
    assert sorted(_attributes(s)) == [("a", 1), ("b", 2)]

    class Both:
        __slots__ = ("x", "__dict__")

    both = Both()
    both.x, both.y = 1, 2
    assert sorted(_attributes(both)) == [("x", 1), ("y", 2)]

    class Hostile:
        def __getattribute__(self, name):
            raise RuntimeError("no")
    hostile = object.__new__(Hostile)
    object.__setattr__(hostile, "m", 3)
    assert _attributes(hostile) == [("m", 3)]


# -- 2. writes no op shows, between two steps: compared before the step takes its digests again ------

def _model_and_opt(**kwargs: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, between: object = None) -> None:
    data = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    for i in range(steps):
        model(data).pow(2).mean().backward()
        opt.step()  # the step line
        opt.zero_grad()
        if i == 0 and callable(between):
            between()


STEP_LINE = _train.__code__.co_firstlineno + 4


def _numpy_write(model: torch.nn.Module) -> None:
    model[0].weight.detach().numpy()[0, 0] = 42.0


def _pointer_write(model: torch.nn.Module) -> None:
    import ctypes

    ctypes.c_float.from_address(model[2].bias.data_ptr()).value = -7.0


@pytest.mark.parametrize("level", ["full", "light"])
@pytest.mark.parametrize("write, path", [(_numpy_write, "model.0.weight"), (_pointer_write, "model.2.bias")])
def test_a_write_no_op_shows_between_steps_is_found_at_the_next_step(level: str, write: object, path: str) -> None:
    model, opt = _model_and_opt()
    with kvguard.guard_module(model, optimizer=opt, action="record", level=level) as g:
        _train(model, opt, 3, between=lambda: write(model))  # type: ignore[operator]
    assert [(e.path, e.kind, e.lineno) for e in g.report.events] == [(path, "unobserved", STEP_LINE)]
    event = g.report.events[0]
    assert "since the last optimizer step" in event.diff and "writing line is not known" in event.diff
    assert g.report.events[0].filename == __file__


def test_under_raise_the_step_after_a_hidden_write_does_not_run() -> None:
    model, opt = _model_and_opt()
    with pytest.raises(kvguard.MutationError) as info:
        with kvguard.guard_module(model, optimizer=opt, action="raise"):
            _train(model, opt, 1)
            _numpy_write(model)
            before = [p.detach().clone() for p in model.parameters()]
            _train(model, opt, 1)
    assert info.value.event.path == "model.0.weight" and info.value.event.lineno == STEP_LINE
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step did not run


@pytest.mark.parametrize("level", ["full", "light"])
@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_intended_writes_between_steps_pass_and_training_is_unchanged(level: str, kind: str) -> None:
    """load_state_dict, a conversion, batch norm's statistics and foreach/fused steps pass; a write
    an op reported is not reported again at the step; weights bitwise as without kvguard."""
    def run(guarded: bool) -> tuple[list[torch.Tensor], list[tuple[str, str]]]:
        model, opt = _model_and_opt(**{kind: True})
        saved = {k: v.clone() for k, v in model.state_dict().items()}

        def between() -> None:
            model.load_state_dict(saved)
            model.double().float()
            with torch.no_grad():
                model[0].bias.add_(1.0)  # at level full: reported at its op, once
        if not guarded:
            _train(model, opt, 4, between)
            return [t.detach().clone() for t in model.state_dict().values()], []
        with kvguard.guard_module(model, optimizer=opt, action="record", level=level) as g:
            _train(model, opt, 4, between)
        return [t.detach().clone() for t in model.state_dict().values()], [(e.path, e.kind) for e in g.report.events]
    plain, _ = run(False)
    guarded, events = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded))
    # level light sees no op: the bias write is found at the next step, as one change
    assert events == [("model.0.bias", "write" if level == "full" else "unobserved")]


# -- 6. a module's own buffer updates: batch norm at level light, spectral_norm's hook ---------------

def _discriminator() -> torch.nn.Module:
    torch.manual_seed(0)
    sn = torch.nn.utils.spectral_norm
    return torch.nn.Sequential(sn(torch.nn.Linear(3, 8)), torch.nn.LeakyReLU(0.2), torch.nn.BatchNorm1d(8),
                               sn(torch.nn.Linear(8, 1)))


@pytest.mark.parametrize("level", ["full", "light"])
def test_batch_norm_and_spectral_norm_update_their_own_buffers_unreported(level: str) -> None:
    d = _discriminator()
    opt = torch.optim.Adam(d.parameters(), lr=1e-3)
    with kvguard.guard_module(d, optimizer=opt, action="raise", level=level) as g:
        for _ in range(3):
            d(torch.randn(8, 3)).mean().backward()
            opt.step()
            opt.zero_grad()
        g.check()
        d.eval()
        d(torch.randn(8, 3))
    assert g.report.events == []
    assert g.protected_count == 13  # 2 x (weight_orig, bias, weight_u, weight_v), batch norm's 2 + 3


@pytest.mark.parametrize("level", ["full", "light"])
def test_a_stray_write_to_a_buffer_outside_its_module_is_still_reported(level: str) -> None:
    """Level full sees who writes: a stray write to a self-updating buffer is reported. Level light
    sees no forward: such buffers (batch norm's, spectral norm's) are taken again at each
    comparison, as documented; a buffer no module updates itself is compared at both."""
    d = _discriminator()
    d.register_buffer("mask", torch.ones(3))
    opt = torch.optim.Adam(d.parameters(), lr=1e-3)
    with kvguard.guard_module(d, name="d", optimizer=opt, action="record", level=level) as g:
        d(torch.randn(8, 3)).mean().backward()
        opt.step()
        d[0].weight_u.detach().numpy()[0] = 3.0   # no op shows it; d[0] is not called again
        d[2].running_var.detach().numpy()[:] = 0.0
        d.mask.detach().numpy()[1] = 0.0
    expected = ["d.0.weight_u", "d.2.running_var", "d.mask"] if level == "full" else ["d.mask"]
    assert sorted(e.path for e in g.report.events) == expected


def test_which_modules_update_their_own_buffers() -> None:
    from kvguard._torch import training as _training

    sn = torch.nn.utils.spectral_norm(torch.nn.Linear(3, 3))
    psn = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(3, 3))
    yes = [torch.nn.BatchNorm1d(3), torch.nn.InstanceNorm2d(3, track_running_stats=True), torch.nn.SyncBatchNorm(3),
           sn, psn.parametrizations.weight[0], torch.ao.quantization.MinMaxObserver()]
    no = [torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.BatchNorm1d(3)), psn, torch.nn.LayerNorm(3)]
    assert [_training.updates_own_buffers(m) for m in yes] == [True] * len(yes)
    assert [_training.updates_own_buffers(m) for m in no] == [False] * len(no)


def test_a_hook_writing_a_parameter_is_not_the_modules_own_update() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)

    def meddle(module: torch.nn.Module, args: object) -> None:
        with torch.no_grad():
            module.weight.mul_(0.5)  # a forward pre-hook writing the weight: reported
    model.register_forward_pre_hook(meddle)
    with kvguard.guard_module(model, action="record") as g:
        model(torch.randn(2, 3))
    assert [(e.path, e.op) for e in g.report.events] == [("model.weight", "aten.mul_.Tensor")]


def test_a_hidden_write_to_batch_norm_statistics_is_not_absorbed_by_its_next_update() -> None:
    """Level full: batch norm's own update is intended, but what changed before it, with no op
    showing it, is found (before the update hides it) and reported at the next step."""
    d = _discriminator()
    opt = torch.optim.Adam(d.parameters(), lr=1e-3)
    with kvguard.guard_module(d, name="d", optimizer=opt, action="record") as g:
        for i in range(3):
            d(torch.randn(8, 3)).mean().backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                d[2].running_mean.detach().numpy()[:] = 5.0   # then the next forward updates it
                d[3].weight_u.detach().numpy()[:] = 1.0
    assert sorted((e.path, e.kind) for e in g.report.events) == [("d.2.running_mean", "unobserved"),
                                                                  ("d.3.weight_u", "unobserved")]


# -- 4. `to_empty()` and any `_apply` that changes values, not dtype or device ---------------------

def _small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


@pytest.mark.parametrize("level", ["full", "light"])
def test_to_empty_on_a_guarded_model_is_reported(level: str) -> None:
    model = _small()
    with kvguard.guard_module(model, action="record", level=level) as g:
        model.to_empty(device="cpu")  # the line
    line = test_to_empty_on_a_guarded_model_is_reported.__code__.co_firstlineno + 4
    # every parameter and buffer, the zero-filled ones too (uninitialised memory may hold anything)
    assert sorted(e.path for e in g.report.events) == sorted(n for n, _ in [*model.named_parameters("model"),
                                                                              *model.named_buffers("model")])
    assert {e.lineno for e in g.report.events} == {line}


def test_to_empty_under_raise_stops_or_raises_at_its_line() -> None:
    model = _small()
    with pytest.raises(kvguard.MutationError) as info:
        with kvguard.guard_module(model, action="raise", level="light"):
            model.to_empty(device="cpu")
    assert info.value.event.path == "model.0.weight" and "to_empty" in info.value.event.diff


@pytest.mark.parametrize("level", ["full", "light"])
def test_conversions_pass_and_a_value_changing_apply_is_reported(level: str) -> None:
    model = _small()
    with kvguard.guard_module(model, action="raise", level=level) as g:
        model.double().float().half().float().to(torch.bfloat16).to(torch.float32)
        model.cpu().share_memory().type(torch.float32)
        model._apply(lambda t: t.to(torch.float64))  # a caller's own conversion: dtype changed, passes
        if level == "light":  # (level full reports its `.data =` at the op: other memory, same values)
            model._apply(lambda t: t.clone())  # a caller's own function that keeps the values: passes
        g.check()
    assert g.report.events == []
    with kvguard.guard_module(model, action="record", level=level) as g:
        model._apply(lambda t: t * 2 if t.is_floating_point() else t)
    # Zeros twice are the same values (batch norm's bias and running_mean); num_batches_tracked is not
    # floating point. Where `.data =` is watched (level full) each parameter's is reported at the op,
    # whatever its values.
    changed = {"model.0.bias", "model.0.weight", "model.1.running_var", "model.1.weight"}
    found = [e.path for e in g.report.events]
    allowed = changed | ({"model.1.bias"} if level == "full" else set())
    assert len(found) == len(set(found)) and changed <= set(found) <= allowed


def test_to_empty_of_a_meta_model_and_of_an_unguarded_module_pass() -> None:
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 2)
    other = _small()
    with kvguard.guard_module(meta, action="record") as g:
        meta.to_empty(device="cpu")  # the usual deferred initialisation: nothing held values
        other.to_empty(device="cpu")  # not guarded
        assert g.report.events == []
        with torch.no_grad():
            meta.weight.mul_(0)  # the weights are guarded, in their new memory
    assert [(e.path, e.op) for e in g.report.events] == [("meta.weight", "aten.mul_.Tensor")]


# -- 5. no reference cycle: an optimizer is freed when its last name goes -------------------------

@pytest.mark.parametrize("scheduler_first", [False, True])
def test_an_optimizer_stepped_under_a_guard_is_freed_without_the_collector(scheduler_first: bool) -> None:
    model = torch.nn.Linear(3, 2)
    torch.optim.SGD(model.parameters()).add_param_group  # torch's lazy imports, done once before measuring
    gc.collect()
    gc.disable()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1) if scheduler_first else None
        with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
            if sched is None:
                assert type(opt.step).__name__ == "WeaklyBound" and opt.step.__self__ is opt
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps ours
            for _ in range(2):
                model(torch.randn(4, 3)).sum().backward()
                opt.step()
                sched.step()  # no "lr_scheduler.step() before optimizer.step()" warning (filterwarnings=error)
            assert g.report.events == [] and g._protected.steps == 2
        assert sched.get_last_lr() == [pytest.approx(0.1 * 0.1 ** 2)]
        ref = weakref.ref(opt)
        del opt, sched, g
        assert ref() is None
    finally:
        gc.enable()


def test_a_weakly_bound_step_reads_as_a_bound_method() -> None:
    from kvguard._guard.module import WeaklyBound

    class Box:
        def get(self, x: int) -> tuple[object, int]:
            return self, x
    box = Box()
    Box.get.marker = 1  # type: ignore[attr-defined]
    bound = WeaklyBound(Box.get, box)
    assert bound(3) == (box, 3) and bound.__self__ is box and bound.__func__ is Box.get and bound.marker == 1
    del box
    assert bound.__self__ is None
    with pytest.raises(ReferenceError):
        bound(3)


# -- 7. an FSDP-style free of a protected tensor's storage, under every engine and level ------------

ENGINES = ("compiled", "kernels", "mode")


@pytest.mark.parametrize("level", ["full", "light"])
@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_a_storage_freed_inside_the_guard_is_found_at_exit(engine: str, level: str) -> None:
    x = torch.randn(16)
    kept = torch.randn(8)
    moved = torch.randn(8)
    batch = {"x": x, "view": x[4:8], "kept": kept, "moved": moved}
    with kvguard.guard(batch, action="record", level=level) as g:
        x.untyped_storage().resize_(0)  # FSDP's free: no op writes, the memory is gone
        moved.share_memory_()  # a move that keeps the values: no change
    assert sorted((e.path, e.kind) for e in g.report.events) == [("batch['view']", "unobserved"),
                                                                 ("batch['x']", "unobserved")]
    assert all("memory changed" in e.diff for e in g.report.events)


def test_device_comparisons_are_combined_there_and_read_once() -> None:
    """Digests on a device are compared there at each step and read at the boundary (no host
    synchronisation per step); 0-d CPU tensors stand in for device digests here."""
    from kvguard._protect.weights_steps import DeviceComparisons

    class E:  # an entry, by identity
        pass
    a, b, c = E(), E(), E()
    later = DeviceComparisons()
    d = [torch.tensor(v) for v in (1, 2, 3, 4)]
    later.add([a, b], [d[0], d[1]], [d[0], d[1]])  # no change
    later.add([a, b], [d[0], d[1]], [d[0], d[2]])  # b changed at this step
    later.add([a, b], [d[0], d[2]], [d[0], d[2]])  # and stays: still found
    later.add([c], [d[3]], [d[0]])
    assert later.collect() == [b, c]  # type: ignore[comparison-overlap]
    assert later.collect() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("level", ["full", "light"])
def test_on_a_gpu_the_comparisons_add_no_synchronisation_and_still_find(level: str) -> None:
    """Steps and batch norm's forwards compare digests on the device (no host sync, checked with
    sync debug "error"); what they found is read and reported at the boundary."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(8, 16, device="cuda")
    with kvguard.guard_module(model, optimizer=opt, action="record", level=level) as g:
        for i in range(5):
            with warnings.catch_warnings():  # "a prototype feature": a warning, under filterwarnings=error
                warnings.simplefilter("ignore")
                torch.cuda.set_sync_debug_mode("error" if i >= 2 else "default")
            try:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                if i == 3 and level == "light":
                    with torch.no_grad():
                        model[2].bias.add_(1.0)  # level light sees no op: a change the next step compares
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert [e.path for e in g.report.events] == (["model.2.bias"] if level == "light" else [])


def test_an_optimizer_made_where_a_freed_one_was_keeps_its_weights_watched() -> None:
    """Each optimizer is known by its own key: one made at a freed one's address (its id) does
    not lose its weights when the set lets go of what the freed one held."""
    from kvguard._guard.module import ModuleGuard

    found = []
    with ModuleGuard([], (), name="weights", action="record") as g:
        for i in range(20):
            model = torch.nn.Linear(3, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g.add_optimizer(opt, [(f"model{i}", model)], [])
            del opt  # freed at once: what only it held is let go at the next look
            opt = torch.optim.SGD(model.parameters(), lr=0.1)  # often at the same address
            g.add_optimizer(opt, [(f"model{i}", model)], [])
            with torch.no_grad():
                model.bias.add_(1.0)
            found.append(len(g.report.events))
            del opt, model
    assert found == list(range(1, 21))


def test_a_module_loaded_with_assign_updates_its_shared_batch_norm_statistics_unreported() -> None:
    # PyTorch's test_load_state_dict_assign_meta: `load_state_dict(state, assign=True)` puts the
    # state's tensors, views of the guarded module's buffers, into a module built on meta; its
    # batch norm's own forward then updates the statistics both modules share.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.device("meta"):
        loaded = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    with kvguard.guard_module(model, optimizer=opt, name="model", action="raise") as g:
        loaded.load_state_dict(model.state_dict(), assign=True)
        loaded(torch.randn(5, 3))  # batch norm's forward: running_mean, running_var, num_batches_tracked
        with pytest.raises(kvguard.MutationError) as caught:
            with torch.no_grad():
                loaded[1].running_mean.add_(1)  # not batch norm's forward: a stray write
    assert caught.value.event.path == "model.1.running_mean"
    assert int(model[1].num_batches_tracked) == 1 and len(g.report.events) == 1
