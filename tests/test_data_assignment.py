"""`t.data = other` on a protected tensor is reported at the assignment, in every guard.

Assigning `.data` dispatches no op (it swaps the TensorImpl's storage in C), so before it
was found only at the boundary, with no line. Megatron-Bridge #1929 is the motivating
bug: `hf_weights.data = hf_weights.data - 1` on the source model's live norm weight.
"""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import kvguard
from kvguard._torch import patches as _patches
from tests.processes import run_python

OP = "Tensor.data assignment"


def line_of(marker: str) -> int:
    return next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if marker in text and "line_of(" not in text)


def test_raise_blocks_the_assignment_before_it_happens() -> None:
    d = {"w": torch.ones(3)}
    w, ptr = d["w"], d["w"].data_ptr()
    with pytest.raises(kvguard.MutationError) as caught:
        with kvguard.guard(d, name="rd", action="raise"):
            w.data = torch.zeros(3)  # REPOINT-RAISE
    event = caught.value.event
    assert (event.path, event.op, event.kind, event.blocked) == ("rd['w']", OP, "repoint", True)
    assert event.lineno == line_of("# REPOINT-RAISE")
    assert str(caught.value).splitlines()[0] == (
        f"rd['w'] would be re-pointed to other memory by {OP} at test_data_assignment.py:{event.lineno}")
    assert w.data_ptr() == ptr and torch.equal(w, torch.ones(3))  # it keeps its memory


def test_record_reports_it_and_follows_the_new_memory() -> None:
    d = {"w": torch.ones(3)}
    w = d["w"]
    with kvguard.guard(d, name="rd", action="record") as g:
        w.data = w.data - 1  # REPOINT-RECORD
        w.add_(5)  # WRITE-AFTER
    assert [(e.path, e.op, e.kind, e.lineno) for e in g.report.events] == [
        ("rd['w']", OP, "repoint", line_of("# REPOINT-RECORD")),
        ("rd['w']", "aten.add_.Tensor", "write", line_of("# WRITE-AFTER")),
    ]
    assert torch.equal(w, torch.full((3,), 5.0))


def test_a_parameter_and_a_protected_view() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    base = torch.zeros(6)
    d = {"p": p, "v": base[2:4]}
    with kvguard.guard(d, name="m", action="record") as g:
        p.data = p.data * 2
        d["v"].data = torch.ones(2)
    assert [(e.path, e.kind) for e in g.report.events] == [("m['p']", "repoint"), ("m['v']", "repoint")]
    assert torch.equal(base, torch.zeros(6))  # re-pointing a view writes nothing into its base


def test_repointing_an_unprotected_view_writes_nothing_protected() -> None:
    d = {"x": torch.ones(4)}
    with kvguard.guard(d, name="rd", action="raise") as g:
        view = d["x"][:2]
        view.data = torch.zeros(2)  # the view now holds other memory; x is untouched
        fresh = torch.ones(2)
        fresh.data = torch.zeros(2)
    assert not g.report.events and torch.equal(d["x"], torch.ones(4))


def test_allowed_paths_and_blocks_apply() -> None:
    d = {"w": torch.ones(3)}
    with kvguard.guard(d, name="rd", action="raise", allow=["rd['w']"]) as g:
        d["w"].data = torch.zeros(3)
    assert torch.equal(d["w"], torch.zeros(3))
    d = {"w": torch.ones(3)}
    with kvguard.guard(d, name="rd", action="raise"):
        with kvguard.allow("a weight sync re-points on purpose"):
            d["w"].data = torch.zeros(3)
    assert torch.equal(d["w"], torch.zeros(3))


def test_an_assignment_from_another_thread_is_seen_there() -> None:
    d = {"w": torch.ones(3)}
    errors: list[BaseException] = []

    def other() -> None:
        try:
            d["w"].data = torch.zeros(3)  # REPOINT-THREAD
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with kvguard.guard(d, name="rd", action="record") as g:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert not errors
    assert [(e.path, e.kind, e.lineno) for e in g.report.events] == [
        ("rd['w']", "repoint", line_of("# REPOINT-THREAD"))]


def test_conversions_are_a_weights_guards_own_writes_and_a_stray_one_is_not() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with kvguard.guard_module(m, optimizer=opt, action="raise") as g:
        m.double()
        m.float()
        m(torch.randn(2, 3)).sum().backward()
        opt.step()
    assert not g.report.events
    kept = m[1].weight.detach().clone()
    with pytest.raises(kvguard.MutationError, match=r"^m\.1\.weight would be re-pointed"):
        with kvguard.guard_module(m, optimizer=opt, action="raise"):
            m[1].weight.data = m[1].weight.data - 1
    assert torch.equal(m[1].weight, kept)


def test_the_property_is_there_only_while_a_full_guard_is() -> None:
    assert not _patches.data_is_watched()
    with kvguard.guard({"a": torch.ones(1)}, name="a", action="record"):
        with kvguard.guard({"b": torch.ones(1)}, name="b", action="record"):
            assert _patches.data_is_watched()
        assert _patches.data_is_watched()
    assert not _patches.data_is_watched() and "data" not in torch.Tensor.__dict__
    with kvguard.guard({"a": torch.ones(1)}, name="a", action="record", level="light") as g:
        assert not _patches.data_is_watched()
    x = torch.ones(2)
    x.data = torch.zeros(2)  # plain torch again
    assert torch.equal(x, torch.zeros(2)) and not g.report.events


def test_deleting_data_is_refused_as_torch_refuses_it() -> None:
    """PyTorch's test_attribute_deletion: `del x.data` raises torch's RuntimeError with the
    property in place too (it had no deleter: AttributeError), and `x.data = None` TypeError."""
    x = torch.randn(5, 5, requires_grad=True)
    with kvguard.guard({"x": torch.ones(1)}, name="x", action="raise"):
        assert _patches.data_is_watched()
        with pytest.raises(RuntimeError, match="Deleting tensor data is not allowed"):
            del x.data
        with pytest.raises(TypeError):
            x.data = None  # type: ignore[assignment]


def test_data_set_to_its_own_elements_is_no_repoint() -> None:
    """`m.to(its own device)` does `p.data = p` in `Module._apply`: nothing changes, so a saved
    Parameter is not reported (PyTorch's test_nn: test_Linear, test_transformerdecoder); a
    conversion that moves the elements still is."""
    m = torch.nn.Linear(3, 3)
    with kvguard.guard_autograd(action="record") as g:
        y = (m.weight * m.weight).sum()  # mul saves the Parameter itself
        m.to("cpu")
        m.weight.data = m.weight.data
        assert not g.report.events
        m.double()
    assert [(e.op, e.kind) for e in g.report.events] == [("Tensor.data assignment", "repoint")]


def test_the_getter_is_torchs_own() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    with kvguard.guard({"p": p}, name="m", action="raise"):
        data = p.data
        assert type(data) is torch.Tensor and not data.requires_grad and data.data_ptr() == p.data_ptr()


BRIDGE = textwrap.dedent("""\
    import torch

    class Mapping:  # the shape of Megatron-Bridge's norm mapping (#1929)
        def megatron_to_hf(self, megatron_weights, hf_weights):
            hf_weights.data = hf_weights.data - 1  # the bug: the source model's live weight
            return hf_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    Mapping().megatron_to_hf(None, model[1].weight)
    print("not caught")
""")


def test_megatron_bridge_shape_caught_at_its_line_by_the_weights_switch(tmp_path: Path) -> None:
    script = tmp_path / "bridge.py"
    script.write_text(BRIDGE)
    done = run_python("-m", "kvguard", "run", "--", sys.executable, script, KVGUARD="raise",
                      KVGUARD_TARGETS="weights")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not caught" not in done.stdout
    assert ("kvguard.MutationError: model.1.weight would be re-pointed to other memory by "
            f"{OP} at bridge.py:5") in done.stderr
    assert "hf_weights.data = hf_weights.data - 1" in done.stderr
