"""`guard_autograd` on real training code (issue 26): no blind stretch, no false alarm.

Gradient checkpointing, `save_on_cpu` and offloading install saved-tensor hooks of their
own, which do not nest with kvguard's: the guard composes with them, so what a
checkpointed forward saves is protected, in the first forward and in the recomputation.
Metadata ops on a saved tensor are seen; patterns name saved tensors by their node; the
exit count is of graphs; gradcheck and RReLU are not reported. The tests that judge
writes run under every engine.
"""

from __future__ import annotations

import gc
import inspect
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import kvguard

ENGINES = ("compiled", "kernels", "mode")
per_engine = pytest.mark.parametrize("engine", ENGINES, indirect=True)
TORCH_SAYS = "modified by an inplace operation"


def _line(marker: str) -> int:
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()  # type: ignore[arg-type]
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)


# -- 1. other saved-tensor hooks: composed, not a blind stretch ---------------------------

W = torch.randn(8, 8, requires_grad=True)
V = torch.randn(8, 8)


def layer(x: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(x @ W, -1)  # softmax saves its result p
    out = p @ V
    p.mul_(2.0)  # the bug
    return out


@per_engine
def test_the_issues_repro_raises_at_the_write_inside_a_checkpointed_layer(engine: str) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(kvguard.MutationError) as info:
        with kvguard.guard_autograd(action="raise"):
            checkpoint(layer, x, use_reentrant=False).sum().backward()
    event = info.value.event
    assert (event.lineno, event.op, event.path) == (_line("p.mul_(2.0)  # the bug"), "aten.mul_.Tensor",
                                                     "<saved by SoftmaxBackward0: result>")
    assert event.placed_at == f"test_autograd_trust.py:{_line('p = torch.softmax(x @ W, -1)')}"


def test_a_write_let_through_behaves_as_without_kvguard_under_checkpointing() -> None:
    """Under record the write is reported and the run goes on exactly as plain PyTorch's
    (no version check added where the checkpoint's own recomputation is what backward reads)."""
    def run() -> torch.Tensor:
        x = torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))
        checkpoint(layer, x, use_reentrant=False).sum().backward()
        return x.grad

    plain = run()
    with kvguard.guard_autograd(action="record") as g:
        guarded = run()
    assert torch.equal(plain, guarded)
    assert [(e.lineno, e.blocked) for e in g.report.events] == [(_line("p.mul_(2.0)  # the bug"), False)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 6))


@pytest.mark.parametrize("kind", ["checkpoint", "save_on_cpu", "nested", "identity_hooks", "detach_hooks"])
def test_clean_runs_under_other_hooks_are_bitwise_the_same_and_protect_what_they_save(kind: str) -> None:
    after_forward = []

    def step(g: Any = None) -> list[torch.Tensor]:
        model = _model()
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
        if kind == "checkpoint":
            out = checkpoint(model, x, use_reentrant=False)
        elif kind == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                out = model(x)
        elif kind == "nested":
            with torch.autograd.graph.save_on_cpu():
                out = checkpoint(model, x, use_reentrant=False)
        else:
            pack = (lambda t: t) if kind == "identity_hooks" else (lambda t: t.detach())
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(x)
        if g is not None:
            after_forward.append(g._protected.protected_count)
        out.pow(2).mean().backward()
        return [x.grad, *(p.grad for p in model.parameters())]

    plain = step()
    with kvguard.guard_autograd(action="raise") as g:
        guarded = step(g)
    assert g.report.ok and all(torch.equal(a, b) for a, b in zip(plain, guarded))
    # The two Linears save input and weight, GELU its input, LayerNorm five: ten, all protected
    # (before composing, a checkpoint's forward protected its input only). The recomputation
    # saves them again (less the last, where the checkpoint stops it), then pow its input.
    checkpointed = kind in ("checkpoint", "nested")
    assert after_forward == [11 if checkpointed else 10]
    assert g.protected_count == (11 + 9 + 1 if checkpointed else 11)


def test_save_on_cpu_and_users_own_hooks_keep_protecting_until_backward_and_not_after() -> None:
    x = torch.randn(3, requires_grad=True)
    for hooks in (torch.autograd.graph.save_on_cpu(),
                  torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
                  torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)):
        with kvguard.guard_autograd(action="record") as g:
            with hooks:
                y = x.sigmoid()  # saves y (its result)
            y.mul_(2)  # on CPU save_on_cpu keeps y itself: backward would read the doubled values
            y.sum().backward()
            y.mul_(2)  # backward has run: what kept it is gone, y is free to change
        assert [(e.path, e.lineno) for e in g.report.events] == [
            ("<saved by SigmoidBackward0: result>", _line("y.mul_(2)  # on CPU save_on_cpu"))], hooks


def test_checkpointed_activations_are_not_kept_alive() -> None:
    """A checkpoint exists to free activations: the guard holds them weakly."""
    refs: list[weakref.ref[torch.Tensor]] = []

    def f(t: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(t @ W)  # saved (tanh's result), freed by the checkpoint after forward
        refs.append(weakref.ref(h))
        return (h * 2).sum(-1)

    x = torch.randn(4, 8, requires_grad=True)
    with kvguard.guard_autograd(action="raise") as g:
        out = checkpoint(f, x, use_reentrant=False)
        gc.collect()
        assert refs[0]() is None  # freed while the graph lives, as without kvguard
        out.sum().backward()
    assert g.report.ok


@per_engine
def test_a_view_a_checkpointed_op_saves_and_drops_at_once_stays_protected_while_its_base_lives(engine: str) -> None:
    """`linear` on a 3-D input saves a 2-D view it makes and drops (a transformer's MLP)."""
    w = torch.randn(5, 8, requires_grad=True)
    held: list[torch.Tensor] = []

    def f(t: torch.Tensor) -> torch.Tensor:
        h = t * 2  # saves nothing (a scalar factor)
        out = torch.nn.functional.linear(h, w)  # saves h.view(-1, 8), a view dropped at once
        held.append(h.data_ptr())
        h.mul_(0.5)  # the bug
        return out.sum()

    with kvguard.guard_autograd(action="record") as g:
        checkpoint(f, torch.randn(2, 3, 8, requires_grad=True), use_reentrant=False).backward()
        gc.collect()
        live = [t for e in g._protected._entries.values() if (t := e.ref()) is not None]
        assert all(t.data_ptr() != held[0] for t in live)  # h freed after forward: its memory not held
    assert [(e.lineno, e.path) for e in g.report.events] == [(_line("h.mul_(0.5)  # the bug"),
                                                              "<saved by MmBackward0: self>")]


def test_a_write_during_the_recomputation_is_reported_at_its_line() -> None:
    """A recomputation that diverges (a write only on the second run) corrupts what backward reads."""
    calls = []

    def f(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        h = torch.tanh(t @ W)  # saved
        out = h @ V
        if len(calls) == 2:
            h.add_(1)  # only in the recomputation
        return out

    with torch.utils.checkpoint.set_checkpoint_early_stop(False), kvguard.guard_autograd(action="record") as g:
        checkpoint(f, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
    assert [(e.lineno, e.path) for e in g.report.events] == [
        (_line("h.add_(1)  # only in the recomputation"), "<saved by TanhBackward0: result>")]


def test_a_guard_entered_inside_a_checkpointed_function_follows_the_outer_one() -> None:
    inner: list[Any] = []

    def f(t: torch.Tensor) -> torch.Tensor:
        with kvguard.guard_autograd(action="record", name="inner") as g:
            h = t.exp()
            h.add_(1)
        inner.append(g)
        return h.sum()

    with kvguard.guard_autograd(action="record", name="outer") as outer:
        checkpoint(f, torch.randn(3, requires_grad=True), use_reentrant=False)
    (g,) = inner
    assert not g.delegated and [e.path for e in g.report.events] == ["<saved by ExpBackward0: result>"]
    assert [e.path for e in outer.report.events] == ["<saved by ExpBackward0: result>"]


def test_torch_func_inside_a_checkpoint_is_refused_as_without_kvguard() -> None:
    """Only kvguard's own hooks step aside for torch.func: not a checkpoint's composed with them."""
    def f(t: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda u: u.sin().sum())(t).sum() + t.sum()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError) as plain:
        checkpoint(f, x, use_reentrant=False)
    with kvguard.guard_autograd(action="raise"), pytest.raises(RuntimeError) as guarded:
        checkpoint(f, x, use_reentrant=False)
    assert str(plain.value) == str(guarded.value)


def test_allow_mutation_on_saved_tensors_inside_a_checkpoint_stays_legal() -> None:
    x = torch.randn(3, requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(t * 1)
        out = y * 3
        y.mul_(2)
        return out.sum()

    with kvguard.guard_autograd(action="raise") as g:
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            f(x).backward()
    assert g.report.ok


def test_hooks_torch_compile_inlines_are_left_alone_and_counted() -> None:
    class Pack(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t * 1

    gm = torch.fx.symbolic_trace(Pack())
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(kvguard.GuardWarning, match="1 unprotected under other saved-tensor hooks"):
        with kvguard.guard_autograd(action="record") as g:
            with torch.autograd.graph.saved_tensors_hooks(gm, gm):
                y = x.exp()
            y.sum().backward()
    assert g.unprotected == 1 and g.report.ok


# -- 2. metadata and re-pointing ops on a saved tensor -----------------------------------

@per_engine
@pytest.mark.parametrize("op", ["t_", "unsqueeze_", "squeeze_", "transpose_", "as_strided_"])
def test_a_metadata_op_on_a_saved_tensor_is_stopped_at_its_line(engine: str, op: str) -> None:
    args = {"t_": (), "unsqueeze_": (0,), "squeeze_": (), "transpose_": (0, 1), "as_strided_": ((4, 3), (3, 1))}
    x = torch.randn(4, 3, requires_grad=True)
    with kvguard.guard_autograd(action="raise") as g:
        y = torch.sigmoid(x * 1)
        with pytest.raises(kvguard.MutationError) as info:
            getattr(y, op)(*args[op])  # the metadata write
        y.sum().backward()  # stopped before it: backward works
    event = info.value.event
    assert event.op.startswith(f"aten.{op}") and event.kind == "metadata" and event.blocked
    assert event.path == "<saved by SigmoidBackward0: result>" and event.lineno == _line("getattr(y, op)(*args[op])")
    assert y._version == 0 and x.grad is not None and len(g.report.events) == 1


@per_engine
def test_repointing_a_saved_input_and_a_sibling_views_metadata_are_reported(engine: str) -> None:
    w = torch.randn(3, 3, requires_grad=True)
    with kvguard.guard_autograd(action="record") as g:
        a = torch.randn(4, 3)
        y = a @ w  # saves a (for w's gradient)
        a.set_(torch.randn(4, 3))  # re-pointed
        b = torch.randn(4, 3)
        z = b @ w
        b.resize_(2, 3)  # shrunk
        base = torch.randn(8, 3)
        u = base[:4] @ w
        base[4:].t_()  # a sibling view: shares base's version counter
        for out in (y, z, u):
            with pytest.raises(RuntimeError, match=TORCH_SAYS):
                out.sum().backward()
    assert [(e.op, e.kind, e.lineno) for e in g.report.events] == [
        ("aten.set_.source_Tensor", "repoint", _line("a.set_(torch.randn(4, 3))")),
        ("aten.resize_.default", "repoint", _line("b.resize_(2, 3)")),
        ("aten.t_.default", "version", _line("base[4:].t_()"))]


@per_engine
def test_metadata_ops_that_touch_no_saved_version_counter_are_not_reported(engine: str) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    with kvguard.guard_autograd(action="raise") as g:
        y = torch.sigmoid(x * 1)
        y.data.t_()  # `.data` has its own version counter, and another TensorImpl
        torch.randn(4, 3).t_()
        y.sum().backward()
        y.t_()  # after backward: nothing needs y
    assert g.report.ok


# -- 3. allow patterns that name a saved tensor by its node ------------------------------

def test_allow_patterns_with_a_star_name_saved_tensors_by_node() -> None:
    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd(action="raise", allow=["<saved by SinBackward0: *", "<saved by *: result>"]) as g:
        y = x * 1
        z = y.sin()  # saves its input
        y.add_(1)  # allowed by the first pattern
        e = x.exp()  # saves its result
        e.add_(1)  # allowed by the second
        c = x * 1
        d = c.cos()  # saves its input: no pattern names it
        with pytest.raises(kvguard.MutationError):
            c.add_(1)
    assert g.report.allowed == {"allow=<saved by SinBackward0: *": 1, "allow=<saved by *: result>": 1}
    assert [e.path for e in g.report.events] == ["<saved by CosBackward0: self>"]
    del z, d


def test_a_star_outside_quotes_and_brackets_is_a_wildcard_and_nothing_else_changes() -> None:
    from kvguard._paths import matcher

    def matches(pattern: str, path: str) -> bool:
        return matcher(pattern).match(path) is not None

    assert matches("<saved by SinBackward0: *", "<saved by SinBackward0: self>")
    assert not matches("<saved by SinBackward0: *", "<saved by CosBackward0: self>")
    assert matches("<saved by *Backward0: result>", "<saved by ExpBackward0: result>")
    assert not matches("<saved by *Backward0: result>", "<saved by ExpBackward0: self>")
    assert matches("d['a*b'][*]", "d['a*b'][3]") and not matches("d['a*b'][*]", "d['axb'][3]")  # quoted: literal
    assert matches("rollout['kl'][*]", "rollout['kl'][0][1]") and not matches("rollout['kl'][*]", "rollout['kl2'][0]")


# -- 4. the exit count is of graphs ------------------------------------------------------

def test_graphs_are_counted_as_graphs_not_as_stretches_between_backwards() -> None:
    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd() as g:
        outs = [x.sin().exp() for _ in range(5)]
        for out in outs:
            out.sum().backward()
    assert g.graphs == 5
    with kvguard.guard_autograd() as g:
        out = x.sin()
        out.sum().backward(retain_graph=True)
        out.sum().backward()  # the same graph again
        x.exp().sin()  # a forward no backward reads
    assert g.graphs == 2
    with kvguard.guard_autograd() as g:
        for _ in range(3):
            torch.autograd.grad(checkpoint(torch.sin, x, use_reentrant=False).sum(), x)
    assert g.graphs == 3


# -- 5. no false alarms on correct code --------------------------------------------------

def test_gradcheck_and_gradgradcheck_pass_under_raise() -> None:
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    w = torch.randn(4, 2, dtype=torch.double, requires_grad=True)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ b).sigmoid()

    with kvguard.guard_autograd(action="raise") as g:
        assert torch.autograd.gradcheck(f, (x, w))
        assert torch.autograd.gradcheck(f, (x, w), fast_mode=True)
        assert torch.autograd.gradgradcheck(f, (x, w))
        y = torch.tanh(x * 1)
        with pytest.raises(kvguard.MutationError):
            y.data.mul_(0)  # the same kind of write outside gradcheck is still a bug
    assert g.report.allowed and all("gradcheck" in k for k in g.report.allowed)


def test_rrelu_in_training_is_clean_and_bitwise_the_same() -> None:
    def step() -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.RReLU())
        model.train()
        x = torch.randn(4, 5)
        model(x).sum().backward()
        return model[0].weight.grad

    plain = step()
    with kvguard.guard_autograd(action="raise") as g:
        guarded = step()
    assert g.report.ok and torch.equal(plain, guarded)
    x = torch.randn(4, 5, requires_grad=True)
    with kvguard.guard_autograd(action="raise"):
        e = x.exp()
        y = torch.nn.functional.rrelu(e, training=True)  # saves e (and its noise)
        with pytest.raises(kvguard.MutationError) as info:
            e.mul_(2)  # a write to what rrelu saved is still a bug
        y.sum().backward()
    assert info.value.event.path in ("<saved by RreluWithNoiseBackward0: self>", "<saved by ExpBackward0: result>")


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_sparse_gradient_accumulation_with_retain_graph_is_not_a_write_to_the_saved_indices(mode: str) -> None:
    """An EmbeddingBag's sparse gradient keeps the saved `indices` as its own; accumulating into
    it builds new indices and moves no version counter autograd checks."""
    def run() -> torch.Tensor:
        torch.manual_seed(0)
        bag = torch.nn.EmbeddingBag(10, 4, sparse=True, mode=mode)
        out = bag(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4]))
        for _ in range(2):
            out.sum().backward(retain_graph=True)
        out.sum().backward()
        return bag.weight.grad.to_dense()

    plain = run()
    with kvguard.guard_autograd(action="raise") as g:
        guarded = run()
    assert g.report.ok and torch.equal(plain, guarded)
    x = torch.randn(10, 4, requires_grad=True)
    with kvguard.guard_autograd(action="raise"):
        out = torch.nn.functional.embedding_bag(torch.tensor([1, 2]), x, torch.tensor([0]), sparse=True)
        y = torch.randn(2, 4, requires_grad=True).exp()  # saves its result
        sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), y.detach(), (10, 4),  # y's memory as values
                                         check_invariants=True)
        with pytest.raises(kvguard.MutationError):
            sparse.mul_(2)  # scales the values: what exp saved
        del out


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_write_to_a_saved_nested_tensor_fails_backward_with_pytorchs_error() -> None:
    def nested() -> torch.Tensor:
        return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], requires_grad=True)

    with kvguard.guard_autograd(action="record") as g:
        z = nested().tanh()  # saves its result
        z.mul_(2)  # let through
        with pytest.raises(RuntimeError, match=TORCH_SAYS) as info:
            torch.nested.to_padded_tensor(z, 0).sum().backward()
    assert "nested [2, 3], [4, 3]" in str(info.value) and "Internal error" not in str(info.value)
    assert [e.lineno for e in g.report.events] == [_line("z.mul_(2)  # let through")]
    with kvguard.guard_autograd(action="raise"):
        z = nested().tanh()
        with pytest.raises(kvguard.MutationError):
            z.mul_(2)
        assert z._version == 0  # stopped before the write (nested tanh has no backward kernel to run)


# -- the env switch, in a fresh process ---------------------------------------------------

CHECKPOINTED_JOB = """
import torch
from torch.utils.checkpoint import checkpoint
w = torch.randn(8, 8, requires_grad=True); v = torch.randn(8, 8)
def layer(x):
    p = torch.softmax(x @ w, -1); out = p @ v
    if BUG:
        p.mul_(2.0)   # the bug
    return out
for _ in range(2):
    checkpoint(layer, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
print("done")
"""


@pytest.mark.slow  # a process each
@pytest.mark.parametrize("bug", [True, False])
def test_the_env_switch_sees_inside_checkpointed_layers(tmp_path: Any, bug: bool) -> None:
    from processes import run_python

    script = tmp_path / "job.py"
    script.write_text(CHECKPOINTED_JOB.replace("BUG", str(bug)))
    result = run_python(script, cwd=tmp_path, KVGUARD="raise", KVGUARD_TARGETS="autograd")
    if bug:
        assert result.returncode == 1 and "done" not in result.stdout
        assert f'File "{script}", line 8, in layer' in result.stderr
        assert "kvguard.MutationError: <saved by SoftmaxBackward0: result> would be modified in place" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        # Each step: the checkpoint's input, and x, w, p, v inside it; then x, w, p again in the
        # recomputation (the checkpoint stops it at the last).
        assert result.stderr.strip() == ("kvguard: autograd: 16 saved tensors protected in 2 forward passes, "
                                         "no in-place writes")


def test_offloading_hooks_that_keep_ids_and_hooks_that_fail_behave_as_without_kvguard() -> None:
    """An offloader keeping tensors by id (torchtune's style) is composed; a pack that raises raises as it would."""
    stash: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> int:
        stash[len(stash)] = t.clone()  # a copy "offloaded"
        return len(stash) - 1

    x = torch.randn(3, requires_grad=True)
    with kvguard.guard_autograd(action="record") as g:
        with torch.autograd.graph.saved_tensors_hooks(pack, stash.pop):
            y = x.exp()
        y.add_(1)  # backward reads the copy: harmless here, a bug without the offloader
        y.sum().backward()
    assert [e.path for e in g.report.events] == ["<saved by ExpBackward0: result>"] and not stash
    assert torch.allclose(x.grad, x.detach().exp())

    def broken(t: torch.Tensor) -> Any:
        raise ValueError("cannot pack")

    for guarded in (False, True):
        with pytest.raises(ValueError, match="cannot pack"):
            with kvguard.guard_autograd(action="raise") if guarded else torch.enable_grad():
                with torch.autograd.graph.saved_tensors_hooks(broken, lambda t: t):
                    x.exp()


@pytest.mark.parametrize("how", ["retain_graph", "create_graph"])
def test_checkpoint_backward_twice_and_double_backward_are_bitwise_the_same(how: str) -> None:
    def grads() -> torch.Tensor:
        x = torch.linspace(-1, 1, 6, requires_grad=True)
        out = checkpoint(lambda t: (t @ W[:6, :6]).tanh().pow(3), x.expand(2, 6), use_reentrant=False).sum()
        if how == "retain_graph":
            out.backward(retain_graph=True)
            out.backward()
        else:
            (g1,) = torch.autograd.grad(out, x, create_graph=True)
            g1.pow(2).sum().backward()
        return x.grad

    plain = grads()
    with kvguard.guard_autograd(action="raise") as g:
        guarded = grads()
    assert g.report.ok and torch.equal(plain, guarded)


@per_engine
def test_a_metadata_op_inside_a_checkpointed_layer_is_reported(engine: str) -> None:
    def f(t: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(t @ W, -1)  # saves p
        out = p @ V
        p.t_()  # the metadata write
        return out.sum()

    with kvguard.guard_autograd(action="record") as g:
        checkpoint(f, torch.randn(8, 8, requires_grad=True), use_reentrant=False).backward()
    assert [(e.op, e.kind, e.lineno) for e in g.report.events] == [
        ("aten.t_.default", "metadata", _line("p.t_()  # the metadata write"))]
