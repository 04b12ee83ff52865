"""`kvguard.guard_autograd()`: writes to tensors autograd saved for backward, caught at the write.

Each test runs under every engine. What is checked beside the report: autograd's own
check is never weakened (a write let through still fails backward, with kvguard's
explanation added), a clean run computes bitwise the same gradients, and nothing is kept
alive past its graph.
"""

from __future__ import annotations

import gc
import inspect
import warnings
import weakref
from typing import Callable

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import kvguard

TORCH_SAYS = "modified by an inplace operation"


def _line(marker: str) -> int:
    """The line of this file holding `marker`."""
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()  # type: ignore[arg-type]
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)


def test_a_write_to_a_saved_result_is_stopped_at_the_write_and_backward_still_works(engine: str) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with kvguard.guard_autograd(action="raise") as g:
        y = torch.sigmoid(x * 2)  # saves its result
        before = y.detach().clone()
        with pytest.raises(kvguard.MutationError) as info:
            y.mul_(2)  # the bug
        y.sum().backward()
    event = info.value.event
    assert event.op == "aten.mul_.Tensor" and event.kind == "write" and event.blocked
    assert event.lineno == _line("y.mul_(2)  # the bug") and event.code == "y.mul_(2)  # the bug"
    assert "SigmoidBackward0" in event.path and event.path == "<saved by SigmoidBackward0: result>"
    assert event.placed_at == f"test_autograd.py:{_line('y = torch.sigmoid(x * 2)')}"
    assert "backward" in str(info.value) and TORCH_SAYS in str(info.value)
    assert torch.equal(y.detach(), before) and y._version == 0  # data and version as they were
    want = torch.sigmoid(x.detach() * 2)
    assert torch.allclose(x.grad, 2 * want * (1 - want))
    assert g.engine == engine and g.report.events == [event]


@pytest.mark.parametrize("action", ["record", "warn"])
def test_a_write_let_through_still_fails_backward_with_the_write_named(engine: str, action: str) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvguard.MutationWarning)
        with kvguard.guard_autograd(action=action) as g:
            y = torch.sigmoid(x * 1)
            y.mul_(2)  # let through
            with pytest.raises(RuntimeError, match=TORCH_SAYS) as info:
                y.sum().backward()
    text = str(info.value)
    assert "is at version 1; expected version 0 instead" in text and "Good luck!" in text
    assert f"aten.mul_.Tensor at test_autograd.py:{_line('y.mul_(2)  # let through')}" in text
    assert [(e.op, e.blocked, e.path) for e in g.report.events] == [
        ("aten.mul_.Tensor", False, "<saved by SigmoidBackward0: result>")]
    assert x.grad is None


def test_a_write_before_backward_that_no_guard_saw_is_explained_as_such(engine: str) -> None:
    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd(action="raise"):
        y = x.exp()
    y.add_(1)  # after the guard: not reported, but backward's check stays on
    with pytest.raises(RuntimeError, match=TORCH_SAYS) as info:
        y.sum().backward()
    assert "where kvguard did not watch" in str(info.value)


def test_a_sibling_slice_write_changes_no_saved_element_but_is_reported_as_a_version_bump(engine: str) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with kvguard.guard_autograd(action="record") as g:
        base = x * 1
        a, b = base[:2], base[2:]
        z = a.pow(2)  # saves a
        b.mul_(3)  # no element of a changes, but a's version does
        with pytest.raises(RuntimeError, match=TORCH_SAYS) as info:
            z.sum().backward()
    (event,) = g.report.events
    assert event.kind == "version" and event.path == "<saved by PowBackward0: self>" and not event.blocked
    assert "version counter" in event.headline() and "no saved element changed" in event.headline()
    assert "no saved element changed" in kvguard.MutationError(event.headline(), event, g.report).args[0] + (
        "no saved element changed")
    assert "its version counter only" in str(info.value)


def test_a_sibling_slice_write_is_stopped_under_raise_and_backward_works(engine: str) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with kvguard.guard_autograd(action="raise"):
        base = x * 1
        a, b = base[:2], base[2:]
        z = a.pow(2)
        with pytest.raises(kvguard.MutationError) as info:
            b.mul_(3)
        assert a._version == b._version == 0
        z.sum().backward()
    assert info.value.event.kind == "version"
    assert torch.allclose(x.grad[:2], 2 * x.detach()[:2]) and torch.equal(x.grad[2:], torch.zeros(2, 3))


def test_a_slice_of_another_storage_and_a_data_copy_are_not_version_bumps(engine: str) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with kvguard.guard_autograd(action="raise") as g:
        a = (x * 1)[:2]
        z = a.pow(2)
        other = torch.zeros(4, 3)
        other[2:].mul_(3)  # another storage
        z.sum().backward()
    assert g.report.ok


def test_a_write_through_data_is_caught_though_autograd_never_sees_it(engine: str) -> None:
    """`.data` has its own version counter: without kvguard the gradient is silently wrong."""
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(kvguard.MutationError) as info:
        with kvguard.guard_autograd(action="raise"):
            y = torch.tanh(x * 1)
            y.data.mul_(0)
    assert info.value.event.path == "<saved by TanhBackward0: result>"


def test_no_write_gives_bitwise_the_same_gradients_and_a_clean_report(engine: str) -> None:
    def step() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                    torch.nn.Linear(16, 4))
        x = torch.randn(5, 8)
        loss = torch.nn.functional.cross_entropy(model(x).log_softmax(-1), torch.tensor([0, 1, 2, 3, 0]))
        loss.backward()
        return [p.grad for p in model.parameters()]

    plain = step()
    with kvguard.guard_autograd(action="raise") as g:
        guarded = step()
    assert g.report.ok and g.protected_count > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded))


def test_writes_after_backward_are_not_reported_and_retain_graph_keeps_protecting(engine: str) -> None:
    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd(action="record") as g:
        y = x.sigmoid()
        y.sum().backward()
        y.mul_(2)  # backward has run: nothing needs y any more
        assert g.report.ok
        w = x.sigmoid()
        w.sum().backward(retain_graph=True)
        w.mul_(2)  # the graph is still alive: a second backward would need w
        assert len(g.report.events) == 1
        u = x * 1
        s = u.pow(2)  # saves u
        del s  # its graph is freed without a backward
        gc.collect()
        u.add_(1)
    assert [e.path for e in g.report.events] == ["<saved by SigmoidBackward0: result>"]


def test_double_backward_gives_the_same_gradients(engine: str) -> None:
    def grads() -> torch.Tensor:
        x = torch.linspace(-1, 1, 5, requires_grad=True)
        (g1,) = torch.autograd.grad(x.pow(3).sin().sum(), x, create_graph=True)
        g1.sum().backward()
        return x.grad

    plain = grads()
    with kvguard.guard_autograd(action="raise") as g:
        guarded = grads()
    assert g.report.ok and torch.equal(plain, guarded)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_checkpointed_functions_input_written_before_backward_is_caught(engine: str, reentrant: bool) -> None:
    w = torch.randn(3, 3, requires_grad=True)
    a = torch.randn(4, 3, requires_grad=True)
    with kvguard.guard_autograd(action="record") as g:
        x = a * 1.0
        out = checkpoint(lambda t, m: torch.tanh(t @ m), x, w, use_reentrant=reentrant)
        x.mul_(2)  # the checkpoint's input: backward recomputes from it
        with pytest.raises(RuntimeError, match=TORCH_SAYS):
            out.sum().backward()
    assert [e.op for e in g.report.events] == ["aten.mul_.Tensor"]
    assert g.report.events[0].lineno == _line("x.mul_(2)  # the checkpoint's input")


def test_checkpointing_and_save_on_cpu_give_the_same_gradients(engine: str) -> None:
    def step(kind: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        lin = torch.nn.Linear(6, 6)
        x = torch.randn(4, 6, requires_grad=True)
        if kind == "checkpoint":
            out = checkpoint(lambda t: torch.tanh(lin(t)).exp(), x, use_reentrant=False)
        else:
            with torch.autograd.graph.save_on_cpu():
                out = torch.tanh(lin(x)).exp()
        out.sum().backward()
        return [x.grad, lin.weight.grad, lin.bias.grad]

    for kind in ("checkpoint", "save_on_cpu"):
        plain = step(kind)
        with kvguard.guard_autograd(action="raise") as g:
            guarded = step(kind)
        assert g.report.ok and all(torch.equal(a, b) for a, b in zip(plain, guarded)), kind


def test_allow_mutation_on_saved_tensors_is_respected_inside_and_outside(engine: str) -> None:
    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd(action="raise") as g:
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            y = torch.sigmoid(x * 1)
            y.mul_(2)  # legal here: autograd keeps a copy
            y.sum().backward()
    s = torch.sigmoid(x.detach())
    assert torch.allclose(x.grad, 2 * s * (1 - s)) and g.report.ok  # the copy autograd kept
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        with pytest.warns(kvguard.GuardWarning, match="other saved_tensors_hooks"):
            with kvguard.guard_autograd(action="raise") as g:
                y = torch.sigmoid(x * 1)
                y.mul_(2)
        assert g.delegated and g.report.ok


def test_a_custom_functions_saved_output_written_through_a_view(engine: str) -> None:
    """verl #6935: `div_` on a view of a custom Function's output, which its forward saved."""

    class ScaledSoftmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits):  # type: ignore[no-untyped-def]
            probs = logits.softmax(-1)
            ctx.save_for_backward(probs)
            return probs

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            (probs,) = ctx.saved_tensors
            return probs * (grad - (grad * probs).sum(-1, keepdim=True))

    logits = torch.randn(2, 5, requires_grad=True)
    with pytest.raises(kvguard.MutationError) as info:
        with kvguard.guard_autograd(action="raise"):
            probs = ScaledSoftmax.apply(logits)
            probs[0].div_(0.7)  # the bug
    assert info.value.event.path == "<saved by ScaledSoftmaxBackward: saved_tensors[0]>"
    with kvguard.guard_autograd(action="raise") as g:  # the fix: a new tensor
        probs = ScaledSoftmax.apply(logits)
        scaled = probs / 0.7
        scaled.sum().backward()
    assert g.report.ok


def _caught_and_clean_when_fixed(run: Callable[..., torch.Tensor]) -> kvguard.MutationEvent:
    """A corpus bug, `run(fixed=...)` as its users wrote it: without kvguard backward raises
    PyTorch's error; under the guard the write is stopped (its event is returned); the fix is clean."""
    with pytest.raises(RuntimeError, match=TORCH_SAYS):
        run(fixed=False).backward()
    with pytest.raises(kvguard.MutationError) as info:
        with kvguard.guard_autograd(action="raise"):
            run(fixed=False)
    with kvguard.guard_autograd(action="raise") as g:
        run(fixed=True).backward()
    assert g.report.ok
    return info.value.event


def test_inputs_embeds_plus_zero_times_image_embeds_mean(engine: str) -> None:
    """verl #5881: `inputs_embeds += 0.0 * image_embeds.mean()` on embeddings a layer saved."""
    torch.manual_seed(0)
    embed, proj = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4)
    ids, image = torch.tensor([[1, 2, 3]]), torch.randn(2, 4, requires_grad=True)
    gate_weight = torch.nn.Parameter(torch.ones(4))

    def forward(fixed: bool) -> torch.Tensor:
        inputs_embeds = embed(ids)
        gate = inputs_embeds * gate_weight  # saves inputs_embeds (for gate_weight's gradient)
        if fixed:
            inputs_embeds = inputs_embeds + 0.0 * image.mean()
        else:
            inputs_embeds += 0.0 * image.mean()  # the bug
        return proj(inputs_embeds + gate).sum()

    event = _caught_and_clean_when_fixed(forward)
    assert event.code == "inputs_embeds += 0.0 * image.mean()  # the bug"
    assert event.path == "<saved by MulBackward0: self>"


def test_slime_get_log_probs_and_entropy_divides_the_models_output_in_place(engine: str) -> None:
    """slime #214: `logits = output.squeeze(0); logits.div_(temperature)` on a saved output."""
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(8, 16)
    hidden = torch.randn(1, 5, 8)
    temperature = 0.7

    def get_log_probs_and_entropy(fixed: bool) -> torch.Tensor:
        output = torch.tanh(lm_head(hidden))  # the model's output: its last op saves its result
        logits = output.squeeze(0)
        if fixed:
            logits = logits.div(temperature)
        else:
            logits.div_(temperature)  # the bug
        log_probs = logits.log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_probs.mean() + entropy.mean()

    event = _caught_and_clean_when_fixed(get_log_probs_and_entropy)
    assert event.path == "<saved by TanhBackward0: result>"
    assert event.lineno == _line("logits.div_(temperature)  # the bug")


def test_a_training_step_with_batch_norm_dropout_lstm_and_adamw_reports_nothing(engine: str) -> None:
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True),
                               torch.nn.Flatten(), torch.nn.Dropout(0.1), torch.nn.Linear(4 * 6 * 6, 8))
    lstm, norm = torch.nn.LSTM(8, 8, batch_first=True), torch.nn.LayerNorm(8)
    params = [*conv.parameters(), *lstm.parameters(), *norm.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    x = torch.randn(2, 3, 8, 8)
    with kvguard.guard_autograd(action="raise") as g:
        for _ in range(3):
            seq, _ = lstm(conv(x).unsqueeze(1))
            loss = norm(seq).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
    assert g.report.ok and g.graphs == 3 and g.protected_count > 30


def test_guard_and_guard_autograd_at_once_each_report_their_own(engine: str) -> None:
    rollout = {"kl": [torch.ones(3)]}
    x = torch.randn(3, requires_grad=True)
    with kvguard.guard(rollout, action="record") as rg, kvguard.guard_autograd(action="record") as ag:
        rollout["kl"][0].mul_(2)
        y = x.exp()
        y.add_(1)
    assert [e.path for e in rg.report.events] == ["rollout['kl'][0]"]
    assert [e.path for e in ag.report.events] == ["<saved by ExpBackward0: result>"]


def test_nothing_saved_warns_and_nothing_is_kept_alive(engine: str) -> None:
    with pytest.warns(kvguard.GuardWarning, match="no op saved one for backward"):
        with torch.no_grad(), kvguard.guard_autograd():
            torch.randn(3).exp()
    x = torch.randn(64, 64, requires_grad=True)
    with kvguard.guard_autograd() as g:
        y = torch.tanh(x @ x)
        ref = weakref.ref(y)
        del y
        gc.collect()
        assert ref() is None
        assert g._protected.alive == 0 or (g._protected.look() or g._protected.alive == 0)


def test_memory_is_flat_over_many_steps(engine: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(8, 16)

    def steps(n: int) -> None:
        for _ in range(n):
            model(data).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    with kvguard.guard_autograd(action="raise") as g:
        steps(50)
        gc.collect()
        saved_then = len(g._protected._entries)
        objects_then = len(gc.get_objects())
        steps(400)
        gc.collect()
        # A leak of one entry or one object per step fails these bounds after 400 steps.
        assert len(g._protected._entries) <= saved_then + 8
        assert len(gc.get_objects()) < objects_then + 200
        g._protected.look()
        assert g._protected.alive == 0  # every graph's saved tensors let go once its backward ran
    assert g.report.ok and g.graphs == 450


def test_a_backward_hook_that_writes_a_saved_tensor_is_seen(engine: str) -> None:
    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd(action="record") as g:
        y = x.sigmoid()
        z = y * 2
        z.register_hook(lambda grad: y.mul_(2))  # runs inside backward, before SigmoidBackward0 reads y
        with pytest.raises(RuntimeError, match=TORCH_SAYS):
            z.sum().backward()
    assert [(e.op, e.path) for e in g.report.events] == [("aten.mul_.Tensor", "<saved by SigmoidBackward0: result>")]


def test_autocast_allow_and_compile(engine: str) -> None:
    model = torch.nn.Linear(4, 4)
    with kvguard.guard_autograd(action="raise") as g:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(2, 4)).sigmoid()
        out.float().sum().backward()
    assert g.report.ok and g.protected_count >= 2
    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd(action="raise", allow=["<saved by ExpBackward0: result>"]) as g:
        y = x.exp()
        y.add_(1)  # intended: counted, not reported
    assert g.report.ok and g.report.allowed == {"allow=<saved by ExpBackward0: result>": 1}

    @torch.compile(backend="aot_eager")
    def f(a: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ a.T).sum()

    a = torch.randn(4, 4, requires_grad=True)
    f(a).backward()
    plain, a.grad = a.grad, None
    with kvguard.guard_autograd(action="raise") as g:
        f(a).backward()
    assert g.report.ok and g.protected_count > 0 and torch.equal(plain, a.grad)


def test_nested_autograd_guards_each_report_the_write(engine: str) -> None:
    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd(action="record", name="outer") as outer:
        with kvguard.guard_autograd(action="record", name="inner") as inner:
            y = x.exp()
            y.add_(1)
        z = x.sigmoid()
        z.mul_(2)  # after the inner guard: the outer's only
    assert not inner.delegated and [e.path for e in inner.report.events] == ["<saved by ExpBackward0: result>"]
    assert [e.path for e in outer.report.events] == ["<saved by ExpBackward0: result>",
                                                     "<saved by SigmoidBackward0: result>"]


def test_a_loop_with_no_write_op_keeps_no_entries_of_freed_graphs(engine: str) -> None:
    x = torch.randn(8, requires_grad=True)
    with kvguard.guard_autograd() as g:
        for _ in range(3000):
            (g_x,) = torch.autograd.grad(x.sigmoid().exp().sum(), x)  # no in-place op anywhere
        assert len(g._protected._entries) < 1000
    assert g.report.ok and g.protected_count == 6000


def test_a_tensor_subclass_that_refuses_detach_still_trains(engine: str) -> None:
    class Stubborn(torch.Tensor):
        def detach(self):  # type: ignore[no-untyped-def, override]
            raise RuntimeError("no")

    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd(action="raise") as g:
        y = x.as_subclass(Stubborn).exp()
        y.sum().backward()
    assert x.grad is not None and g.report.ok


# torch.func's first forward-mode use in a process scripts torch's jvp decompositions (torch.jit):
# a DeprecationWarning, a FutureWarning from torch 2.14 on.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_torch_func_transforms_run_under_the_guard_with_the_same_results(engine: str) -> None:
    """torch.func refuses saved-tensor hooks: the guard's step aside inside a transform."""
    import torch.utils._pytree as pytree

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x).pow(2).sum()

    x = torch.randn(3)

    def transforms() -> tuple:  # type: ignore[type-arg]
        return (torch.func.grad(f)(x), torch.func.jacrev(torch.sin)(x), torch.func.hessian(f)(x),
                torch.func.vjp(torch.sin, x)[1](torch.ones(3)), torch.vmap(torch.sin)(torch.ones(2, 3)))

    want = transforms()
    with pytest.warns(kvguard.GuardWarning, match="4 unprotected .*torch.func transforms"):
        with kvguard.guard_autograd(action="raise") as g:
            got = transforms()
            y = torch.randn(3, requires_grad=True).exp()
            with pytest.raises(kvguard.MutationError):
                y.add_(1)  # after the transforms: protected again
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(want), pytree.tree_leaves(got)))
    assert [e.path for e in g.report.events] == ["<saved by ExpBackward0: result>"]
    assert g.unprotected == 4  # grad, jacrev, hessian, vjp: stretches not looked at, never called clean (vmap saves none)

    def inner(t: torch.Tensor) -> torch.Tensor:
        with pytest.warns(kvguard.GuardWarning, match="inside a torch.func transform"):
            with kvguard.guard_autograd():
                out = torch.sin(t).sum()
        return out

    assert torch.allclose(torch.func.grad(inner)(x), torch.cos(x))


def test_saved_tensors_not_yet_protected_are_held_weakly(engine: str) -> None:
    """A graph freed before any write op (no look yet) frees what it saved at once: the peak
    memory of a backward stays autograd's (it frees each node's saved tensors as it goes)."""
    x = torch.randn(1000, requires_grad=True)
    with kvguard.guard_autograd() as g:
        z = x.exp().sin()  # saves exp's result and sin's input: nothing has looked at them yet
        assert g._protected.alive == 2
        del z  # the graph goes, with no write op in between
        assert g._protected.alive == 0
