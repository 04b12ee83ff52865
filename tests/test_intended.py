"""Well-known intended writers (`kvguard/_intended.py`): let through with no setting, listed by the CLI.

The library code here is a stand-in compiled under the library's module name (a scope is
found by the module and qualified name of a frame on the writing op's stack), so the
tests need neither peft nor trl; tests/test_real_libraries.py runs the real ones. Also
`nn.RReLU(inplace=True)` in training (its noise is the op's own write) under every engine.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

import kvguard
from kvguard import _intended
from kvguard.__main__ import main

ENGINES = ("compiled", "kernels", "mode")
per_engine = pytest.mark.parametrize("engine", ENGINES, indirect=True)

# peft's `merge` and data-driven LoRA inits and trl's `_sync_target_model` as they write, compiled under
# their module names.
LIBRARY_CODE = {
    "peft.tuners.lora.layer": '''
class Linear:
    def __init__(self, base_layer, delta):
        self.base_layer, self.delta = base_layer, delta
    def merge(self, safe_merge=False):
        if safe_merge:
            merged = self.base_layer.weight.data.clone() + self.delta
            self.base_layer.weight.data = merged
        else:
            self.base_layer.weight.data += self.delta
    def unmerge(self):
        self.base_layer.weight.data -= self.delta
''' + "".join(f'''
    def {init}(self):  # moves the base weight's principal part into the adapter
        self.base_layer.weight.data = self.base_layer.weight.data - self.delta
''' for init in ("pissa_init", "olora_init", "corda_init", "loftq_init", "lora_ga_init")),
    "trl.trainer.callbacks": '''
class SyncRefModelCallback:
    @staticmethod
    def _sync_target_model(model, target_model, alpha):
        for target_param, copy_param in zip(target_model.parameters(), model.parameters(), strict=True):
            target_param.data.mul_(1.0 - alpha).add_(copy_param.data, alpha=alpha)
''',
}


def _library(module: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": module}
    exec(compile(LIBRARY_CODE[module], f"<{module}>", "exec"), namespace)  # noqa: S102 - the tests' own code
    return namespace


def _line(marker: str) -> int:
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()  # type: ignore[arg-type]
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("safe_merge", [False, True])
def test_a_lora_merge_and_unmerge_pass_under_raise_and_are_counted(safe_merge: bool) -> None:
    model, opt = _trained()
    layer = _library("peft.tuners.lora.layer")["Linear"](model[0], torch.full((4, 4), 0.5))
    before = model[0].weight.detach().clone()
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        _step(model, opt)
        stepped = model[0].weight.detach().clone()
        layer.merge(safe_merge=safe_merge)
        layer.unmerge()
        _step(model, opt)
    assert g.report.ok, g.report.format()
    assert not torch.equal(before, stepped)
    assert list(g.report.allowed) == ["intended writer peft LoRA merge"]
    # `+=` on `.data` is an add_ (its `.data =` lays out the same elements again: no re-point);
    # safe_merge re-points once; unmerge as `+=`
    assert g.report.allowed["intended writer peft LoRA merge"] == 2


@pytest.mark.parametrize("init", ["pissa_init", "olora_init", "corda_init", "loftq_init", "lora_ga_init"])
def test_a_lora_initialisation_from_the_base_weights_passes_after_a_load(init: str) -> None:
    model, opt = _trained()
    layer = _library("peft.tuners.lora.layer")["Linear"](model[0], torch.full((4, 4), 0.5))
    with kvguard.guard_module(model, action="raise") as g:
        model.load_state_dict(model.state_dict())  # watched from here on, as after loading a checkpoint
        getattr(layer, init)()  # get_peft_model(init_lora_weights=...) re-points the base weight
        with pytest.raises(kvguard.MutationError):
            model[1].weight.data.mul_(2)  # another weight, outside the library: still stopped
    assert dict(g.report.allowed) == {"intended writer peft LoRA initialisation from the base weights": 1}


def test_torch_initialisers_pass_after_a_load_and_a_direct_write_is_still_stopped() -> None:
    model, opt = _trained()
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        model.load_state_dict(model.state_dict())  # a checkpoint loaded: watched from here on
        model[1].reset_parameters()  # a new head
        torch.nn.init.zeros_(model[1].bias)
        _step(model, opt)
        with pytest.raises(kvguard.MutationError) as info:
            model[1].bias.data.zero_()  # not through an initialiser: a stray write
    assert dict(g.report.allowed) == {"intended writer torch's initialisers": 3}
    assert info.value.event.path == "model.1.bias" and info.value.event.lineno == _line("zero_()  # not through")


def test_the_same_write_outside_the_library_is_still_stopped_at_its_line() -> None:
    model, opt = _trained()
    with kvguard.guard_module(model, optimizer=opt, action="raise"):
        _step(model, opt)
        with pytest.raises(kvguard.MutationError) as info:
            model[0].weight.data += 0.5  # the stray write
    assert info.value.event.path == "model.0.weight" and info.value.event.lineno == _line("+= 0.5  # the stray")


def test_trls_reference_sync_passes_and_a_stray_write_to_the_reference_does_not() -> None:
    policy, opt = _trained()
    ref, _ = _trained()
    sync = _library("trl.trainer.callbacks")["SyncRefModelCallback"]._sync_target_model
    with kvguard.guard_module(ref, action="raise", name="ref") as g:
        for _ in range(2):
            _step(policy, opt)
            sync(policy, ref, 0.5)
        with pytest.raises(kvguard.MutationError) as info:
            with torch.no_grad():
                ref[1].bias.mul_(0.5)  # a stray write to the reference model
    assert g.report.allowed == {"intended writer trl SyncRefModelCallback": 16}
    assert info.value.event.path == "ref.1.bias" and info.value.event.lineno == _line("ref[1].bias.mul_(0.5)")


def test_outside_its_version_range_a_writer_is_not_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_intended, "_installed", lambda distribution: "0.20.0" if distribution == "peft" else None)
    model, opt = _trained()
    layer = _library("peft.tuners.lora.layer")["Linear"](model[0], torch.ones(4, 4))
    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        layer.merge()
    assert [e.op for e in g.report.events] == ["aten.add_.Tensor"]  # `.data +=`'s assignment is no re-point
    assert not g.report.allowed
    assert "not applied: peft 0.20.0 installed is outside >=0.21,<1" in _intended.describe(width=1000)


def test_user_scopes_still_work_beside_them() -> None:
    model, opt = _trained()
    layer = _library("peft.tuners.lora.layer")["Linear"](model[0], torch.ones(4, 4))
    with kvguard.guard_module(model, optimizer=opt, action="raise", allow=["model.1.bias"]) as g:
        layer.merge()
        with torch.no_grad():
            model[1].bias.zero_()  # allow=
            with kvguard.allow("re-initialise the head"):
                model[1].weight.zero_()
    assert g.report.ok and g.report.allowed == {
        "intended writer peft LoRA merge": 1, "allow=model.1.bias": 1, "kvguard.allow('re-initialise the head')": 1}


def test_weights_writers_are_not_autograd_writers_and_the_reverse() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    base = torch.nn.Linear(4, 4)
    layer = _library("peft.tuners.lora.layer")["Linear"](base, torch.ones(4, 4))
    with kvguard.guard_autograd(action="record") as g:
        y = torch.sigmoid(x * 1)
        layer.base_layer = type("B", (), {"weight": type("W", (), {"data": y})()})()
        layer.merge()  # writes what sigmoid saved, from peft's merge: not autograd's intended writer
    assert [e.path for e in g.report.events] == ["<saved by SigmoidBackward0: result>"]
    assert {w.name for w in _intended.scopes("weights")} == {
        "peft LoRA merge", "peft LoRA initialisation from the base weights", "torch's initialisers",
        "transformers weight initialisation and embedding resize", "trl SyncRefModelCallback",
        "torch parametrizations", "torch lazy modules' initialisation"}
    assert {w.name for w in _intended.scopes("autograd")} == {"torch.autograd.gradcheck perturbation"}


def test_the_table_names_functions_the_installed_torch_has() -> None:
    for writer in _intended.WRITERS:
        assert writer.target in ("weights", "autograd") and writer.how in ("scope", "rule")
        assert (writer.how == "rule") == bool(writer.where) and writer.why and writer.writes
        assert _intended.in_range(writer.read_in, writer.versions), writer.name
        if writer.distribution != "torch":
            continue
        for function in writer.functions:
            module, _, qualname = function.partition(":")
            if "*" in function:  # a pattern: some function the installed torch has matches it
                assert _matches_some_function(module, qualname), function
                continue
            owner: Any = importlib.import_module(module)
            for part in qualname.split("."):
                owner = getattr(owner, part)
            assert callable(owner), function


def _matches_some_function(module: str, qualname: str) -> bool:
    import fnmatch
    import sys

    for name in [m for m in list(sys.modules) if fnmatch.fnmatchcase(m, module)]:
        for value in vars(sys.modules[name]).values():
            members = [value] + (list(vars(value).values()) if isinstance(value, type) else [])
            for member in members:
                code = getattr(member, "__code__", None)
                if code is not None and member.__module__ == name and fnmatch.fnmatchcase(code.co_qualname, qualname):
                    return True
    return False


@pytest.mark.parametrize(("version", "versions", "inside"), [
    ("2.13.0+cpu", ">=2.4,<3", True), ("2.4", ">=2.4,<3", True), ("3.0.0", ">=2.4,<3", False),
    ("0.21.2", ">=0.21,<1", True), ("0.20.9", ">=0.21,<1", False), ("1.16.0rc1", ">=1.16,<2", True),
    ("0.9.0.dev0", ">=0.21", False)])
def test_version_ranges(version: str, versions: str, inside: bool) -> None:
    assert _intended.in_range(version, versions) is inside


def test_the_cli_lists_every_writer_with_what_it_writes_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["intended"]) == 0
    out = capsys.readouterr().out
    for writer in _intended.WRITERS:
        assert f"{writer.name} ({writer.target}; {writer.distribution} {writer.versions}, read in" in out
    assert "peft.tuners.*:*.merge" in out and "built into kvguard" in out
    assert "torch.autograd.gradcheck:_compute_numerical_gradient" in out
    assert max(map(len, out.splitlines())) <= 100


# -- RReLU(inplace=True): the noise is the op's own write --------------------------------

def _rrelu_step(inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.RReLU(inplace=inplace), torch.nn.Linear(5, 1))
    model.train()
    loss = model(torch.randn(4, 5)).sum()
    loss.backward()
    return loss.detach(), model[0].weight.grad  # type: ignore[return-value]


@per_engine
@pytest.mark.parametrize("inplace", [True, False])
def test_rrelu_in_training_is_clean_and_bitwise_the_same(engine: str, inplace: bool) -> None:
    plain = _rrelu_step(inplace)
    with kvguard.guard_autograd(action="raise") as g:
        guarded = _rrelu_step(inplace)
    assert g.report.ok and g.protected_count
    assert torch.equal(plain[0], guarded[0]) and torch.equal(plain[1], guarded[1])


@per_engine
def test_rrelu_in_place_over_a_tensor_another_op_saved_is_still_stopped(engine: str) -> None:
    x = torch.randn(4, 5, requires_grad=True)
    with kvguard.guard_autograd(action="raise"):
        e = x.exp()  # saves its result
        with pytest.raises(kvguard.MutationError) as info:
            torch.nn.functional.rrelu(e, training=True, inplace=True)  # writes e
        e.sum().backward()
    assert info.value.event.path == "<saved by ExpBackward0: result>"
    assert info.value.event.op == "aten.rrelu_with_noise_.default"


def test_only_a_written_argument_no_return_aliases_is_unreturned() -> None:
    from kvguard import _torch

    aten = torch.ops.aten
    assert _torch.op_facts(aten.rrelu_with_noise_.default).unreturned == (1,)  # noise
    assert _torch.op_facts(aten._amp_update_scale_.default).unreturned == (1,)  # growth_tracker
    assert _torch.op_facts(aten.rrelu_with_noise.out).unreturned == (0,)  # noise; `out` is returned
    for op in (aten.add_.Tensor, aten.mul.out, aten._foreach_add_.List, aten.index_put_.default):
        assert _torch.op_facts(op).unreturned == (), op
