"""A tensor placed into a guarded dict is protected as it is stored (Python 3.12+ dict watchers).

Issue 37's case: a streamed weight parked in a dict as a view of a host buffer that the
streamer refills with no torch op before the weight is used. Where the interpreter tells
kvguard of the store (`kvguard._protect.stores`), the placed values are digested then, so
that change is found; elsewhere (Python 3.11) a placement is first read at the next write
op, and a change before it is the placement's own values (pinned below, so the docs stay
true on each interpreter).
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import pytest
import torch

import kvguard
from kvguard._protect import stores

THIS_FILE = __file__.rsplit("/", 1)[-1]
needs_watchers = pytest.mark.skipif(not stores.AVAILABLE, reason="dict watchers: Python 3.12+")


def _line(fn: Any, mark: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    return f"{THIS_FILE}:{start + next(i for i, text in enumerate(lines) if text.rstrip().endswith(mark))}"


def _events(g: Any) -> list[tuple[str, str, str]]:
    return [(e.path, e.kind, e.placed_at or "") for e in g.report.events]


def _parked(pending: dict[str, Any], host: torch.Tensor) -> None:
    pending["w"] = host[:4].view(2, 2)  # MARK: parked
    host.numpy()[:] = 7  # the streamer refills its buffer: no torch op
    assert float(pending["w"].sum()) == 28.0  # the weight is used: a read


def test_the_interpreter_says_whether_stores_are_heard() -> None:
    assert stores.AVAILABLE == (sys.version_info >= (3, 12))


@needs_watchers
@pytest.mark.parametrize("action", ["record", "raise"])
def test_a_parked_view_refilled_by_a_non_torch_writer_is_found(action: str) -> None:
    host = torch.zeros(8)
    pending: dict[str, Any] = {}
    if action == "raise":
        with pytest.raises(kvguard.MutationError, match=r"pending\['w'\] changed during the guard"):
            with kvguard.guard(pending, name="pending", action="raise"):
                _parked(pending, host)
        return
    with kvguard.guard(pending, name="pending", action="record") as g:
        _parked(pending, host)
    assert _events(g) == [("pending['w']", "unobserved", _line(_parked, "# MARK: parked"))]


def test_without_watchers_the_parked_change_is_the_placements_own_values() -> None:
    if stores.AVAILABLE:
        pytest.skip("this interpreter hears the store")
    host = torch.zeros(8)
    pending: dict[str, Any] = {}
    with kvguard.guard(pending, name="pending", action="record") as g:
        _parked(pending, host)
    assert g.report.events == []  # docs/protected.md says so: the next op (here, the exit) reads it


def _placed_changed_then_written(rd: dict[str, Any]) -> None:
    rd["w"] = w = torch.zeros(4)  # MARK: placed
    w.numpy()[0] = 5
    w.add_(1)  # MARK: written


@needs_watchers
def test_a_change_before_the_first_write_is_reported_at_that_write() -> None:
    rd: dict[str, Any] = {}
    with kvguard.guard(rd, name="rd", action="record") as g:
        _placed_changed_then_written(rd)
    placed, written = _line(_placed_changed_then_written, "# MARK: placed"), \
        _line(_placed_changed_then_written, "# MARK: written")
    assert [(e.path, e.kind, e.site, e.placed_at) for e in g.report.events] == [
        ("rd['w']", "unobserved", written, placed), ("rd['w']", "write", written, placed)]


def _store_in_a_helper(rd: dict[str, Any], t: torch.Tensor) -> None:
    rd["kl"] = t  # MARK: helper-store


@needs_watchers
@pytest.mark.parametrize("shape", ["item", "nested", "update-empty", "update", "setdefault", "ior", "namespace"])
def test_every_store_form_is_digested_and_located(shape: str) -> None:
    t = torch.ones(3)
    root: Any = types.SimpleNamespace(x=torch.zeros(1)) if shape == "namespace" else (
        {"inner": {}} if shape == "nested" else {} if shape == "update-empty" else {"x": torch.zeros(1)})
    with kvguard.guard(root, name="d", action="record") as g:
        if shape == "item":
            _store_in_a_helper(root, t)
        elif shape == "nested":
            root["inner"]["kl"] = t
        elif shape in ("update", "update-empty"):
            root.update(kl=t, n=3)
        elif shape == "setdefault":
            root.setdefault("kl", t)
        elif shape == "ior":
            root |= {"kl": t}
        else:
            root.kl = t
        t.numpy()[0] = 9  # no torch op, and no op before the exit
    path = {"nested": "d['inner']['kl']", "namespace": "d.kl"}.get(shape, "d['kl']")
    [event] = g.report.events
    assert (event.path, event.kind) == (path, "unobserved")
    if shape == "item":  # the helper's own line, though its frame has returned (the source search said "first seen")
        assert event.placed_at == _line(_store_in_a_helper, "# MARK: helper-store")
    else:
        assert event.placed_at is not None and event.placed_at.startswith(THIS_FILE)


@needs_watchers
def test_a_clean_placement_is_silent_and_scalars_never_enter_python() -> None:
    heard: list[object] = []
    metrics: dict[str, Any] = {"loss": torch.zeros(1)}
    with kvguard.guard(metrics, name="metrics", action="raise") as g:
        stores.listen(metrics, heard.append)  # beside the guard's own listener
        try:
            metrics["step"] = 3
            metrics["lr"] = 1e-4
            metrics["name"] = "run"
            metrics["kl"] = torch.ones(2)
        finally:
            stores.unlisten(metrics, heard.append)
    assert g.report.events == []
    assert [type(v) for v in heard] == [torch.Tensor]


@needs_watchers
def test_the_dicts_are_let_go_at_exit_and_shared_by_nested_guards() -> None:
    rd: dict[str, Any] = {"a": torch.zeros(2), "inner": {}}
    with kvguard.guard(rd, name="outer", action="record") as outer:
        with kvguard.guard(rd["inner"], name="inner", action="record") as inner:
            assert {id(d) for d, _ in stores._listeners.values()} >= {id(rd), id(rd["inner"])}
            rd["inner"]["t"] = t = torch.zeros(3)
            t.numpy()[1] = 4
        assert id(rd["inner"]) in stores._listeners  # the outer guard still listens
    assert not stores._listeners, "every dict unwatched once no guard listens"
    assert [(e.path, e.kind) for e in inner.report.events] == [("inner['t']", "unobserved")]
    assert [(e.path, e.kind) for e in outer.report.events] == [("outer['inner']['t']", "unobserved")]
    rd["later"] = torch.zeros(1)  # after the guards: nothing listens, nothing is told


@needs_watchers
def test_a_listener_that_fails_never_breaks_the_users_store() -> None:
    d: dict[str, Any] = {}

    def broken(value: object) -> None:
        raise RuntimeError("a listener's fault")
    stores.listen(d, broken)
    try:
        d["t"] = torch.zeros(1)
        d["u"] = [torch.zeros(1)]
    finally:
        stores.unlisten(d, broken)
    assert list(d) == ["t", "u"]


@needs_watchers
def test_without_fingerprints_nothing_is_taken_early() -> None:
    rd: dict[str, Any] = {}
    with kvguard.guard(rd, name="rd", action="record", fingerprint=False):
        assert not stores._listeners
        rd["t"] = torch.zeros(2)


@needs_watchers
def test_a_guard_left_by_an_exception_unwatches_its_dicts_and_keeps_nothing_alive() -> None:
    import gc
    import weakref

    rd: dict[str, Any] = {"a": torch.zeros(2), "inner": {"b": torch.zeros(1)}}
    placed = torch.zeros(3)
    with pytest.raises(ValueError):
        with kvguard.guard(rd, name="rd", action="record"):
            rd["t"] = placed
            raise ValueError("the user's own error")
    assert not stores._listeners
    ref = weakref.ref(placed)
    del rd, placed
    gc.collect()
    assert ref() is None, "the placed tensor outlived the guard"


@needs_watchers
def test_pinned_memory_in_a_cuda_process_is_read_at_the_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `non_blocking` copy into pinned memory may still be landing when the tensor is stored: its
    first values are read at the next write op, as without watchers (docs/protected.md says so)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    host = torch.zeros(8)
    pending: dict[str, Any] = {}
    with kvguard.guard(pending, name="pending", action="record") as g:
        _parked(pending, host)
    assert g.report.events == []


@needs_watchers
def test_a_swap_right_after_a_heard_store_is_reported_at_its_line() -> None:
    """No write op ran between: the swap looks first, as the tensor is protected from its store."""
    rd: dict[str, Any] = {"x": torch.zeros(1)}
    with kvguard.guard(rd, name="rd", action="record") as g:
        rd["w"] = w = torch.zeros(3)
        torch.utils.swap_tensors(w, torch.ones(3))
    assert [(e.path, e.kind, e.op) for e in g.report.events] == [("rd['w']", "repoint", "torch.utils.swap_tensors")]
