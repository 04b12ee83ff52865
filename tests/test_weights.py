"""`kvguard.guard_module()`: a model's weights, written only where a trainer means to.

Per engine: a clean fine-tuning loop reports nothing; the real bugs' shapes are caught with
the parameter's name and the writing line. Multi-process shapes run as real gloo jobs.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvguard
from processes import free_port

HERE = Path(__file__).parent


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
], ids=["adamw_foreach", "adamw_fused", "sgd_momentum"])
def test_a_clean_fine_tuning_loop_reports_nothing(engine: str, make_opt) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    ema = copy.deepcopy(model)  # not guarded: the EMA copy is written every step
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    data = torch.randn(16, 4)
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        for _ in range(3):
            model(data).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=False)
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
        model.load_state_dict(copy.deepcopy(model.state_dict()))
        model.eval()
        model(data)
    assert g.report.ok, g.report.format()
    assert g.protected_count == 13 and g.engine == engine  # 10 parameters, 3 buffers of batch norm


def test_a_stray_write_between_steps_is_stopped_with_the_parameters_name(engine: str) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with kvguard.guard_module(model, optimizer=opt, action="raise"):
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
        before = model[3].weight.detach().clone()
        with pytest.raises(kvguard.MutationError) as info:
            model[3].weight.data.mul_(2)  # the stray write
    event = info.value.event
    assert (event.path, event.op, event.blocked) == ("model.3.weight", "aten.mul_.Tensor", True)
    assert event.code == "model[3].weight.data.mul_(2)  # the stray write"
    assert torch.equal(model[3].weight.detach(), before)


def test_without_an_optimizer_a_step_is_a_write_to_report(engine: str) -> None:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    with kvguard.guard_module(model, action="record") as g:  # an inference-side model: no step expected
        opt.step()
    assert {e.path for e in g.report.events} == {"model.weight", "model.bias"}


def test_another_modules_forward_writing_a_buffer_is_reported(engine: str) -> None:
    bn = torch.nn.BatchNorm1d(3)
    model = torch.nn.Sequential(bn)
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with kvguard.guard_module(model, action="record") as g:
        model(torch.randn(4, 3))  # its own forward: intended
        assert g.report.ok

        class Meddler(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                bn.running_mean.zero_()  # someone else's buffer
                return x
        Meddler()(other(torch.randn(1, 3)))
    assert [e.path for e in g.report.events] == ["model.0.running_mean"]


def test_megatron_bridge_norm_mapping_repoints_the_source_weight(engine: str) -> None:
    """Megatron-Bridge #1929: a conversion mapping did `w.data = w.data + 1` on the source model."""
    source = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))

    def convert_norm(src_w: torch.Tensor, dst_w: torch.Tensor) -> None:
        src_w.data = src_w.data + 1  # the bug: Gemma-style (1 + w) applied to the source
        dst_w.data.copy_(src_w.data)

    with pytest.raises(kvguard.MutationError) as info:
        with kvguard.guard_module(source, name="source", action="raise"):
            convert_norm(source[1].weight, target[1].weight)
    event = info.value.event
    assert (event.path, event.kind, event.op, event.blocked) == (
        "source.1.weight", "repoint", "Tensor.data assignment", True)
    assert event.code == "src_w.data = src_w.data + 1  # the bug: Gemma-style (1 + w) applied to the source"


def test_verl_lora_merge_then_restore_through_data_copy(engine: str) -> None:
    """verl #7014: merge LoRA into the base weight for a sync, then restore it with `param.data.copy_`."""
    base = torch.nn.Linear(4, 4, bias=False)
    lora_a, lora_b = torch.randn(2, 4), torch.randn(4, 2)
    with kvguard.guard_module(base, name="actor", action="record") as g:
        backup = base.weight.data.clone()
        base.weight.data.add_(lora_b @ lora_a)  # merge
        synced = base.state_dict()  # aliases the live weight
        base.weight.data.copy_(backup)  # restore: `synced` now holds the restored values
        assert torch.equal(synced["weight"], backup)
    assert [(e.path, e.op) for e in g.report.events] == [("actor.weight", "aten.add_.Tensor"),
                                                         ("actor.weight", "aten.copy_.default")]


def test_prime_rl_aliased_buffer_copy_over_loaded_weights(engine: str) -> None:
    """prime-rl #2482: a buffer aliasing a parameter; a stale `copy_` into it over freshly loaded weights."""

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(3, 3))
            self.register_buffer("packed", self.weight.data.view(9), persistent=False)  # an alias

    layer = Layer()
    stale = torch.full((9,), 7.0)
    with kvguard.guard_module(layer, name="layer", action="raise") as g:
        layer.load_state_dict({"weight": torch.ones(3, 3)})  # a reload: intended
        with pytest.raises(kvguard.MutationError) as info:
            layer.packed.copy_(stale)  # the stale copy over the loaded weight
    assert {info.value.event.path, *info.value.event.aliases} <= {"layer.packed", "layer.weight"}
    assert [e.path for e in g.report.events][0] in ("layer.weight", "layer.packed")
    assert torch.equal(layer.weight.detach(), torch.ones(3, 3))


def test_bad_arguments_get_clear_errors() -> None:
    with pytest.raises(TypeError, match="protects a torch.nn.Module"):
        kvguard.guard_module({"w": torch.ones(1)})
    with pytest.raises(TypeError, match="takes torch optimizers"):
        kvguard.guard_module(torch.nn.Linear(1, 1), optimizer=object())


def test_the_step_wrapper_is_undone_and_a_later_scheduler_keeps_working() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with kvguard.guard_module(model, optimizer=opt):
        assert "step" in vars(opt)
    assert "step" not in vars(opt)
    with kvguard.guard_module(model, optimizer=opt):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps step on top of ours
    model(torch.randn(1, 2)).sum().backward()
    opt.step()
    sched.step()  # no "step() before optimizer.step()" warning: the wrappers pass through


@pytest.mark.slow  # two gloo processes each: CI runs them (-m slow)
@pytest.mark.any_engine
@pytest.mark.parametrize("script, expected", [
    ("weights_receive_buffer.py",
     "rank1 events: [('model.weight', 'c10d.broadcast_.default'), ('model.bias', 'c10d.broadcast_.default')]"),
    ("weights_ddp_broadcast.py", "ok=True protected=9"),
], ids=["reused_receive_buffer", "ddp_broadcast_buffers"])
def test_two_process_gloo_jobs(script: str, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD") or k == "KVGUARD_CACHE_DIR"}
    env["PYTHONWARNINGS"] = "ignore"
    result = subprocess.run([sys.executable, str(HERE / "integrations" / script), str(free_port())], env=env,
                            capture_output=True, text=True, timeout=300)
    assert expected in result.stdout, result.stdout + result.stderr[-3000:]
    if script == "weights_ddp_broadcast.py":
        assert result.stdout.count(expected) == 2


def test_grad_scaler_tied_weights_and_nested_guards(engine: str) -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    ids = torch.tensor([1, 2, 3])
    with kvguard.guard_module(model, optimizer=opt, action="raise") as outer:
        with kvguard.guard_module(model["head"], optimizer=opt, name="head", action="raise") as inner:
            for _ in range(2):
                loss = model["head"](model["emb"](ids)).logsumexp(-1).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)  # calls opt.step: intended
                scaler.update()
                opt.zero_grad()
            with pytest.raises(kvguard.MutationError) as info:
                with torch.no_grad():
                    model["emb"].weight[0].zero_()  # one tensor, two names: the first guard to judge stops it
    assert outer.report.events and inner.report.events
    assert {e.path for e in outer.report.events} == {"model.emb.weight"}
    assert {e.path for e in inner.report.events} == {"head.weight"}
    assert info.value.event.path in ("model.emb.weight", "head.weight")
    assert outer.protected_count == 1 and inner.protected_count == 1


def test_a_failing_step_still_gives_its_parameters_back_to_the_guard(engine: str) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken_closure() -> torch.Tensor:
        raise ValueError("closure failed")

    with kvguard.guard_module(model, optimizer=opt, action="record") as g:
        with pytest.raises(ValueError):
            opt.step(broken_closure)
        with torch.no_grad():
            model.weight.add_(1)  # after the failed step: watched again
    assert [e.path for e in g.report.events] == ["model.weight"]


def test_a_step_writing_a_parameter_that_a_buffer_aliases_is_intended(engine: str) -> None:
    class Packed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2, 2))
            self.register_buffer("flat", self.weight.data.view(4), persistent=False)

    model = Packed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        (model.weight * 2).sum().backward()
        opt.step()
        with pytest.raises(kvguard.MutationError):
            model.flat.zero_()  # outside the step: a write to both names
    assert not [e for e in g.report.events if not e.blocked]


def test_kvguard_allow_blocks_count_intended_weight_writes(engine: str) -> None:
    model = torch.nn.Linear(2, 2)
    with kvguard.guard_module(model, action="raise") as g:
        with kvguard.allow("re-initialise the head"), torch.no_grad():
            model.weight.normal_()
    assert g.report.ok and g.report.allowed == {"kvguard.allow('re-initialise the head')": 1}


def test_a_conversion_is_the_trainers_and_the_weights_are_watched_after_it(engine: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with kvguard.guard_module(model, optimizer=opt, action="raise") as g:
        model.double()  # re-points every parameter with p.data = ...: meant
        model.float()
        with pytest.raises(kvguard.MutationError) as info:
            with torch.no_grad():
                model[0].weight.mul_(2)  # after the conversion: the new memory is watched
    assert info.value.event.path == "model.0.weight"
    assert [e.path for e in g.report.events] == ["model.0.weight"]
    assert torch.nn.Module._apply.__module__ == "torch.nn.modules.module"  # undone at exit
