"""Well-known intended writers (`kvguard/_intended.py`): let through with no setting, listed by the CLI.

The library code here is a stand-in compiled under the library's module name (a scope is
found by the module and qualified name of a frame on the writing op's stack), so the
tests need neither peft nor trl; tests/test_real_libraries.py runs the real ones. Also
`nn.RReLU(inplace=True)` in training (its noise is the op's own write) under every engine.
"""

from __future__ import annotations

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
import torch
class Linear(torch.nn.Module):  # a LoraLayer is a module holding the layer it adapts as `base_layer`
    def __init__(self, base_layer, delta):
        super().__init__()
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
''' for init in ("pissa_init", "olora_init", "corda_init", "loftq_init", "lora_ga_init")) + '''
class Straying(Linear):  # not peft's: a merge that also writes outside its own module, as a buggy one would
    def __init__(self, base_layer, delta, other):
        super().__init__(base_layer, delta)
        self.others = [other]  # held, not registered: another module of the model
    def merge(self, safe_merge=False):
        super().merge(safe_merge)
        self.others[0].weight.data.mul_(0.5)
    def pissa_init(self):
        super().pissa_init()
        self.others[0].weight.data.mul_(0.5)
''',
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


def _merge_outside_the_range(monkeypatch: pytest.MonkeyPatch, action: str) -> Any:
    """peft's merge with an installed peft older than every version its writer was read in."""
    monkeypatch.setattr(_intended, "_installed", lambda distribution: "0.9.0" if distribution == "peft" else None)
    model, opt = _trained()
    layer = _library("peft.tuners.lora.layer")["Linear"](model[0], torch.ones(4, 4))
    return model, opt, layer


HINTED = ("written by peft.tuners.lora.layer:Linear.merge: peft LoRA merge, an intended writer kvguard lets through "
          "in peft >=0.10,<1 (read in 12 versions, 0.10.0 to 0.21.2); peft 0.9.0 is installed here, whose code "
          "was not read, so the write is reported. If it is meant, allow it: "
          "allow=['peft.tuners.lora.layer:Linear.merge'] or KVGUARD_ALLOW=peft.tuners.lora.layer:Linear.merge")


def test_outside_its_version_range_a_writer_is_not_applied_and_its_write_names_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, layer = _merge_outside_the_range(monkeypatch, "record")
    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        layer.merge()
        with torch.no_grad():
            model[1].bias.add_(1)  # a stray write while the same peft is installed: no writer named
    assert [(e.op, e.path) for e in g.report.events] == [("aten.add_.Tensor", "model.0.weight"),
                                                          ("aten.add_.Tensor", "model.1.bias")]
    assert not g.report.allowed
    assert g.report.events[0].hint == HINTED
    assert g.report.events[1].hint == ""
    assert "not applied: peft 0.9.0 installed is outside >=0.10,<1" in _intended.describe(width=1000)


def test_outside_its_version_range_raise_says_the_writer_and_the_hint_allows_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, layer = _merge_outside_the_range(monkeypatch, "raise")
    with kvguard.guard_module(model, optimizer=opt, action="raise"):
        with pytest.raises(kvguard.MutationError) as info:
            layer.merge()
    assert f"  hint     {HINTED}" in str(info.value).splitlines()
    with kvguard.guard_module(model, optimizer=opt, action="raise",  # the hint's fix
                              allow=["peft.tuners.lora.layer:Linear.merge"]) as g:
        layer.merge()
    assert g.report.allowed == {"allow=peft.tuners.lora.layer:Linear.merge": 1}


def test_outside_its_version_range_warn_prints_the_hint_in_the_panel(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt, layer = _merge_outside_the_range(monkeypatch, "warn")
    with pytest.warns(kvguard.MutationWarning):
        with kvguard.guard_module(model, optimizer=opt, action="warn"):
            layer.merge()
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())  # the panel, unwrapped
    assert "hint written by peft.tuners.lora.layer:Linear.merge: peft LoRA merge" in err
    assert "(read in 12 versions, 0.10.0 to 0.21.2); peft 0.9.0 is installed here" in err


def test_outside_its_version_range_a_write_the_writer_is_not_meant_to_make_is_not_blamed_on_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _ = _merge_outside_the_range(monkeypatch, "record")
    layer = _library("peft.tuners.lora.layer")["Straying"](model[0], torch.ones(4, 4), model[1])
    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        layer.merge()
    assert [e.path for e in g.report.events] == ["model.0.weight", "model.1.weight"]
    assert g.report.events[0].hint == HINTED  # the base weight, by the merge's innermost frame (its super())
    assert g.report.events[1].hint == ""  # another module's weight: not what a merge writes


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
        base.weight.data = y.detach()  # the base weight's memory is what sigmoid saved
        layer.merge()  # writes what sigmoid saved, from peft's merge: not autograd's intended writer
    assert [e.path for e in g.report.events] == ["<saved by SigmoidBackward0: result>"]
    assert {w.name for w in _intended.scopes("weights")} == {
        "peft LoRA merge", "peft LoRA initialisation from the base weights", "torch's initialisers",
        "transformers weight initialisation and embedding resize", "trl SyncRefModelCallback",
        "torch parametrizations", "torch lazy modules' initialisation", "vLLM post-load transform",
        "sglang post-load transform"}
    assert {w.name for w in _intended.scopes("autograd")} == {"torch.autograd.gradcheck perturbation"}


def test_each_rules_where_names_code_kvguard_has_where_it_says() -> None:
    """A rule's `where` names kvguard's code as `module.Class.attribute`: each resolves, and a
    method is one its class defines itself (not inherits: the name says where to read it)."""
    import importlib
    import re

    for writer in _intended.WRITERS:
        for dotted in re.findall(r"kvguard(?:\.\w+)+", writer.where or ""):
            parts = dotted.split(".")
            cut = next(n for n in range(len(parts), 0, -1) if _importable(".".join(parts[:n])))
            owner: Any = importlib.import_module(".".join(parts[:cut]))
            for name in parts[cut:]:
                assert name in vars(owner), f"{writer.name}: {dotted}: {name} is not defined in {owner!r}"
                owner = vars(owner)[name]


def _importable(name: str) -> bool:
    import importlib

    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def test_the_table_names_functions_the_installed_torch_has() -> None:
    import intended_table

    for writer in _intended.WRITERS:
        assert writer.target in ("weights", "autograd") and writer.how in ("scope", "rule")
        assert (writer.how == "rule") == bool(writer.where) and writer.why and writer.writes
        assert not intended_table.version_errors(writer), writer.name
        # every scope says what it may write: no writer lets through whatever is written while it runs
        assert writer.how == "rule" or all(f.endswith(")") for f in writer.functions), writer.name
        if writer.distribution == "torch":
            assert not intended_table.unmatched(writer), writer.name


def test_the_table_check_finds_a_function_or_an_argument_the_library_lacks() -> None:
    import dataclasses

    import intended_table

    torch_init = next(w for w in _intended.WRITERS if w.name == "torch's initialisers")
    renamed = dataclasses.replace(torch_init, functions=(
        "torch.nn.init:*(tensor)", "torch.nn.init:*(weight)", "torch.nn.init:no_such_init_(tensor)"))
    assert intended_table.unmatched(renamed) == ["torch.nn.init:*(weight)", "torch.nn.init:no_such_init_(tensor)"]
    assert intended_table.version_errors(dataclasses.replace(torch_init, read_in="2.3.1, 2.13.0", tested="2.12.0")) \
        == ["read in 2.3.1, outside >=2.4,<3", "tested in 2.12.0, not read there"]


@pytest.mark.parametrize(("version", "versions", "inside"), [
    ("2.13.0+cpu", ">=2.4,<3", True), ("2.4", ">=2.4,<3", True), ("3.0.0", ">=2.4,<3", False),
    ("0.21.2", ">=0.21,<1", True), ("0.20.9", ">=0.21,<1", False), ("1.16.0rc1", ">=1.16,<2", True),
    ("0.9.0.dev0", ">=0.21", False)])
def test_version_ranges(version: str, versions: str, inside: bool) -> None:
    assert _intended.in_range(version, versions) is inside


def test_the_cli_lists_every_writer_with_what_it_writes_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["intended"]) == 0
    out = capsys.readouterr().out
    flowing = " ".join(out.split())  # a line wraps where the state that follows it is long ("… not installed here")
    for writer in _intended.WRITERS:
        assert f"{writer.name} ({writer.target}; {writer.distribution} {writer.versions}; " in flowing
    assert "peft.tuners.*:*.merge(self)" in out and "built into kvguard" in out
    assert "torch.autograd.gradcheck:_compute_numerical_gradient(entry)" in out
    assert "  read in  0.10.0, 0.11.1," in out and "  tested   0.13.2, 0.17.1, 0.19.1, 0.21.2" in out
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
    from kvguard._torch import ops as _ops

    aten = torch.ops.aten
    assert _ops.op_facts(aten.rrelu_with_noise_.default).unreturned == (1,)  # noise
    assert _ops.op_facts(aten._amp_update_scale_.default).unreturned == (1,)  # growth_tracker
    assert _ops.op_facts(aten.rrelu_with_noise.out).unreturned == (0,)  # noise; `out` is returned
    for op in (aten.add_.Tensor, aten.mul.out, aten._foreach_add_.List, aten.index_put_.default):
        assert _ops.op_facts(op).unreturned == (), op


# -- each writer writes what it is meant to write, not whatever is written while it runs ----------
# (issue 37: a LazyLinear subclass whose reset_parameters() also zeroed another module's weight was
# let through, the lazy modules' writer being found on the stack)

class _ZeroesAnother(torch.nn.LazyLinear):
    """A lazy layer whose initialisation also writes a weight that is not its own (`how`)."""

    def __init__(self, out_features: int, other: torch.nn.Module, how: str) -> None:
        super().__init__(out_features)
        self.others, self.how = [other], how  # a list: held, not registered as a submodule

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.has_uninitialized_params() or not hasattr(self, "others"):
            return  # at construction: nothing to initialise yet
        other = self.others[0]
        if self.how == "data":
            other.weight.data.zero_()  # the other module's weight, through .data
        elif self.how == "no_grad":
            with torch.no_grad():
                other.weight.mul_(0)  # the same, through the Parameter
        elif self.how == "repoint":
            other.weight.data = torch.zeros_like(other.weight)  # re-pointed to new memory


def _lazy_model(how: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 2)
    model = torch.nn.Sequential(_ZeroesAnother(4, head, how), torch.nn.ReLU(), head)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)  # made before the first forward, as PyTorch allows


@pytest.mark.parametrize(("how", "op", "marker"), [
    ("data", "aten.zero_.default", "other.weight.data.zero_()"),
    ("no_grad", "aten.mul_.Tensor", "other.weight.mul_(0)"),
    ("repoint", "Tensor.data assignment", "other.weight.data = torch.zeros_like")])
def test_a_lazy_layers_initialisation_writing_another_modules_weight_is_stopped_at_its_line(
        how: str, op: str, marker: str) -> None:
    model, opt = _lazy_model(how)
    head_before = model[2].weight.detach().clone()
    # Caught outside the guard: torch's Module._call_impl (a module with hooks) catches it with `except
    # Exception:` and runs its always-called hooks before re-raising, which the guard takes for a handler
    # that dropped it (kvguard/_guard/handlers.py) and raises again at its exit
    with pytest.raises(kvguard.MutationError) as info:
        with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
            model(torch.randn(3, 5))  # the first forward materializes and initialises the lazy layer
    assert (info.value.event.path, info.value.event.op) == ("model.2.weight", op)
    assert info.value.event.lineno == _line(marker)
    assert torch.equal(model[2].weight, head_before)  # stopped before the write: the data is intact
    # the lazy layer's own materialization and initialisation before it were let through, and counted
    assert g.report.allowed["intended writer torch lazy modules' initialisation"] >= 2


def test_a_lazy_layers_initialisation_of_its_own_weights_and_submodules_passes() -> None:
    class WithChild(torch.nn.LazyLinear):
        def __init__(self) -> None:
            super().__init__(4)
            self.gate = torch.nn.Linear(4, 4)  # its own submodule: its weights are the lazy layer's to set

        def reset_parameters(self) -> None:
            super().reset_parameters()
            if hasattr(self, "gate"):
                self.gate.weight.data.zero_()

    torch.manual_seed(0)
    model = torch.nn.Sequential(WithChild(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        for _ in range(2):
            _step_lazy(model, opt)
    assert g.report.ok and torch.count_nonzero(model[0].weight) > 0
    assert g.report.allowed["intended writer torch lazy modules' initialisation"] >= 3  # materialize, init, gate


def _step_lazy(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_lazy_layers_initialize_parameters_writing_another_modules_weight_is_stopped() -> None:
    class Initialising(torch.nn.LazyLinear):
        def initialize_parameters(self, input: torch.Tensor) -> None:  # noqa: A002 - torch's own name
            super().initialize_parameters(input)
            with torch.no_grad():
                head.bias.fill_(1.0)  # not this layer's: set during its shape inference

    torch.manual_seed(0)
    head = torch.nn.Linear(4, 2)
    model = torch.nn.Sequential(Initialising(4), head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        _step_lazy(model, opt)
    assert [(e.path, e.lineno) for e in g.report.events] == [("model.1.bias", _line("head.bias.fill_(1.0)"))]


def test_a_writer_that_also_writes_outside_its_module_is_reported_there_and_only_there() -> None:
    model, opt = _trained()
    layer = _library("peft.tuners.lora.layer")["Straying"](model[0], torch.ones(4, 4), model[1])
    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        layer.merge()
        layer.pissa_init()
    # the base layer's writes are the merge's and the init's own; the other layer's are not
    lines = [i for i, text in enumerate(LIBRARY_CODE["peft.tuners.lora.layer"].splitlines(), 1)
             if "self.others[0].weight.data.mul_(0.5)" in text]
    assert [(e.path, e.lineno) for e in g.report.events] == [("model.1.weight", line) for line in lines]
    assert g.report.allowed == {"intended writer peft LoRA merge": 1,
                                "intended writer peft LoRA initialisation from the base weights": 1}


def test_trls_reference_sync_writing_the_policy_is_reported() -> None:
    policy, opt = _trained()
    ref, _ = _trained()
    namespace: dict[str, Any] = {"__name__": "trl.trainer.callbacks"}
    exec(compile(  # noqa: S102 - a sync that writes its source too: not what the reference sync may write
        "class SyncRefModelCallback:\n"
        "    @staticmethod\n"
        "    def _sync_target_model(model, target_model, alpha):\n"
        "        for target_param, copy_param in zip(target_model.parameters(), model.parameters()):\n"
        "            target_param.data.mul_(1.0 - alpha).add_(copy_param.data, alpha=alpha)\n"
        "            copy_param.data.mul_(1.0)\n", "<trl.trainer.callbacks>", "exec"), namespace)
    with kvguard.guard_module(policy, optimizer=opt, action="record", name="policy") as g:
        with kvguard.guard_module(ref, action="raise", name="ref") as r:
            namespace["SyncRefModelCallback"]._sync_target_model(policy, ref, 0.5)
    assert r.report.ok and r.report.allowed == {"intended writer trl SyncRefModelCallback": 8}
    assert [e.path for e in g.report.events] == ["policy.0.weight", "policy.0.bias", "policy.1.weight",
                                                 "policy.1.bias"]


def test_transformers_init_weights_writes_the_module_given_not_the_model() -> None:
    namespace: dict[str, Any] = {"__name__": "transformers.models.tiny.modeling_tiny", "torch": torch}
    exec(compile(  # noqa: S102 - `_init_weights(self, module)` as every transformers model has it
        "class TinyPreTrainedModel(torch.nn.Module):\n"
        "    def _init_weights(self, module):\n"
        "        module.weight.data.normal_()\n"
        "        if self.stray:\n"
        "            self.head.weight.data.zero_()\n"
        "class Block(torch.nn.Linear):\n"
        "    def _init_weights(self):\n"  # a module's own init, with no `module`: its own weights
        "        self.weight.data.fill_(0.5)\n", "<transformers.models.tiny.modeling_tiny>", "exec"), namespace)
    model = namespace["TinyPreTrainedModel"]()
    model.body, model.head, model.stray = namespace["Block"](4, 4), torch.nn.Linear(4, 2), False
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        model._init_weights(model.body)
        model.body._init_weights()
        model.stray = True
        model._init_weights(model.body)  # and the head, which it was not given
    assert [(e.path, e.lineno) for e in g.report.events] == [("model.head.weight", 5)]
    assert g.report.allowed == {"intended writer transformers weight initialisation and embedding resize": 3}


def test_gradchecks_perturbation_is_its_own_but_a_write_by_the_checked_function_is_not() -> None:
    import sys

    perturbed = [0]  # calls made by gradcheck's finite differences, while it perturbs an input
    w = torch.randn(3, dtype=torch.double, requires_grad=True)

    def checked(x: torch.Tensor) -> torch.Tensor:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != "_compute_numerical_gradient":
            frame = frame.f_back
        if frame is not None:
            perturbed[0] += 1
            saved.data.add_(0.0)  # writes what exp saved, from the checked function, not gradcheck's own
        return x * 2

    x = torch.randn(3, dtype=torch.double, requires_grad=True)
    with kvguard.guard_autograd(action="record") as g:
        saved = w.exp()  # saves its result, alive until its backward
        assert torch.autograd.gradcheck(checked, (x,))
        saved.sum().backward()
    assert perturbed[0] == 6  # 3 elements, each perturbed both ways
    assert [(e.path, e.lineno) for e in g.report.events] == [
        ("<saved by ExpBackward0: result>", _line("saved.data.add_(0.0)"))] * 6
