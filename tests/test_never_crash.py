"""kvguard never kills a job (only a MutationError under raise may) and never holds what it should let go.

Each test is a field finding or an adversarial program of the same family: warnings as
errors, a handler that swallows the error, torch.compile around a guarded call, a
generator that outlives the guard stack, a frame whose locals must be let go.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
import types
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import kvguard
from kvguard._activate import importhook as _importhook
from kvguard._presets import Target


# -- a swallowed MutationError -------------------------------------------------------------

def test_a_swallowed_mutation_error_is_raised_again_at_exit() -> None:
    rd = {"k": torch.ones(3)}
    with pytest.raises(kvguard.MutationError, match="caught inside the guard and never read") as excinfo:
        with kvguard.guard(rd, name="rd"):
            try:
                rd["k"].mul_(2)
            except RuntimeError:  # the handler around a collective or an OOM retry
                pass
    assert excinfo.value.event is not None and excinfo.value.event.path == "rd['k']"
    assert str(excinfo.value).startswith("rd['k'] would be modified in place by aten.mul_.Tensor")
    assert torch.equal(rd["k"], torch.ones(3))  # the write never happened


def test_an_error_the_handler_read_is_not_raised_again() -> None:
    rd = {"k": torch.ones(3)}
    seen = []
    with kvguard.guard(rd, name="rd") as g:
        try:
            rd["k"].mul_(2)
        except kvguard.MutationError as err:
            seen.append(str(err))  # logged: somebody looked
    assert len(seen) == 1 and len(g.report.events) == 1


def test_a_second_swallowed_error_counts_even_when_the_first_was_read() -> None:
    rd = {"a": torch.ones(2), "b": torch.ones(2)}
    with pytest.raises(kvguard.MutationError, match=r"rd\['b'\] would be modified"):
        with kvguard.guard(rd, name="rd"):
            try:
                rd["a"].add_(1)
            except kvguard.MutationError as err:
                assert err.event is not None
            try:
                rd["b"].add_(1)
            except RuntimeError:
                pass


def test_an_exception_leaving_the_block_is_never_masked() -> None:
    rd = {"k": torch.ones(3)}
    with pytest.raises(ValueError, match="the user's own error"):
        with kvguard.guard(rd, name="rd"):
            try:
                rd["k"].mul_(2)
            except RuntimeError:
                pass
            raise ValueError("the user's own error")


# -- warnings ------------------------------------------------------------------------------

def test_warn_under_warnings_as_errors_prints_and_runs_on(capsys: Any) -> None:
    rd = {"k": torch.ones(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kvguard.guard(rd, name="rd", action="warn") as g:
            rd["k"].mul_(2)  # must not raise MutationWarning out of the op
            rd["k"].add_(1)
    assert torch.equal(rd["k"], torch.full((3,), 3.0))
    assert [e.op for e in g.report.events] == ["aten.mul_.Tensor", "aten.add_.Tensor"]
    assert [type(w) for w in g.unraised_warnings] == [kvguard.MutationWarning, kvguard.MutationWarning]
    assert "rd['k'] was modified in place by aten.mul_.Tensor" in capsys.readouterr().err


def test_a_broken_showwarning_hook_does_not_break_the_op(monkeypatch: Any, capsys: Any) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("the log server is down")

    monkeypatch.setattr(warnings, "showwarning", broken)
    rd = {"k": torch.ones(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = broken
        with kvguard.guard(rd, name="rd", action="warn") as g:
            rd["k"].mul_(2)
    assert len(g.report.events) == 1 and torch.equal(rd["k"], torch.full((3,), 2.0))
    capsys.readouterr()


def test_guard_warning_for_keys_that_never_appeared() -> None:
    rd = {"a": torch.ones(2)}
    with pytest.warns(kvguard.GuardWarning, match=r"'b' never appeared in rd \(it held 'a'\)"):
        with kvguard.guard(rd, name="rd", keys=["b"]):
            pass


def test_guard_warning_for_a_guard_that_protected_nothing() -> None:
    with pytest.warns(kvguard.GuardWarning, match="protected no tensor"):
        with kvguard.guard({"step": 3, "names": ["a"]}, name="rd"):
            pass


def test_no_guard_warning_when_a_key_appears_inside_the_guard() -> None:
    rd: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kvguard.guard(rd, name="rd", keys=["kl"], action="record") as g:
            rd["kl"] = t = torch.zeros(2)
            t.add_(1)
    assert g.unraised_warnings == [] and len(g.report.events) == 1


def test_guard_warnings_as_errors_never_raise_out_of_the_block(capsys: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kvguard.guard({}, name="rd") as g:
            pass
    assert [type(w) for w in g.unraised_warnings] == [kvguard.GuardWarning]
    assert "kvguard: kvguard.guard(rd) protected no tensor" in capsys.readouterr().err


# -- actions in any case -------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["Warn", "WARN", " warn "])
def test_action_names_are_case_insensitive(spelling: str, capsys: Any) -> None:
    rd = {"k": torch.ones(2)}
    with pytest.warns(kvguard.MutationWarning):
        with kvguard.guard(rd, name="rd", action=spelling) as g:
            rd["k"].add_(1)
    assert g.action == "warn"
    capsys.readouterr()

    @kvguard.guarded("rd", action="RAISE")
    def f(rd: dict[str, torch.Tensor]) -> None:
        rd["k"].add_(1)

    with pytest.raises(kvguard.MutationError):
        f(rd)


def test_a_bad_action_names_itself() -> None:
    with pytest.raises(kvguard.ConfigError, match=re.escape("invalid action 'rase' from kvguard.guard(action=...); expected raise, warn or record")):
        kvguard.guard({}, action="rase")


# -- torch.compile ---------------------------------------------------------------------------

def _shaper(action: str) -> Any:
    @kvguard.guarded("rd", action=action)
    def shape(rd: dict[str, torch.Tensor]) -> torch.Tensor:
        rd["x"].mul_(2)
        return rd["x"] + 1
    return shape


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's imports, not kvguard
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_guarded_function_called_from_compiled_code(backend: str) -> None:
    shape = _shaper("record")
    torch._dynamo.reset()
    rd = {"x": torch.ones(3)}
    out = torch.compile(lambda d: shape(d) * 3, backend=backend)(rd)
    assert torch.equal(out, torch.full((3,), 9.0)) and torch.equal(rd["x"], torch.full((3,), 2.0))
    assert [(e.path, e.op) for e in shape.last_report.events] == [("rd['x']", "aten.mul_.Tensor")]

    raising = _shaper("raise")
    torch._dynamo.reset()
    rd = {"x": torch.ones(3)}
    with pytest.raises(kvguard.MutationError, match=r"rd\['x'\] would be modified"):
        torch.compile(lambda d: raising(d) * 3, backend=backend)(rd)
    assert torch.equal(rd["x"], torch.ones(3))


def test_an_env_activated_target_called_from_compiled_code() -> None:
    module = types.ModuleType("kvguard_test_compiled_target")
    exec(textwrap.dedent("""
        def shape(rd):
            rd["x"].mul_(2)
            return rd["x"] + 1
    """), module.__dict__)
    sys.modules[module.__name__] = module
    try:
        _importhook.patch(module, Target(module.__name__, "shape", "rd"), "raise")
        torch._dynamo.reset()
        rd = {"x": torch.ones(3)}
        with pytest.raises(kvguard.MutationError):
            torch.compile(lambda d: module.shape(d) * 3, backend="aot_eager")(rd)
        assert torch.equal(rd["x"], torch.ones(3))
    finally:
        del sys.modules[module.__name__]


# -- what the guard lets go -----------------------------------------------------------------

def _step_then_free() -> bool:
    act = torch.zeros(1 << 16)
    ref = weakref.ref(act)
    rd: dict[str, torch.Tensor] = {}
    with kvguard.guard(rd, action="record"):
        rd["kl"] = kl = torch.zeros(4)  # placement: the guard reads this frame
        kl.mul_(2)
    del act
    gc.collect()
    return ref() is None


def test_placement_lookup_does_not_pin_the_frames_locals() -> None:
    assert _step_then_free(), "a tensor deleted after the guard is still alive"


def test_a_locals_dict_the_user_holds_is_left_alone() -> None:
    rd: dict[str, torch.Tensor] = {}
    mine = locals()
    with kvguard.guard(rd, action="record") as g:
        rd["kl"] = kl = torch.zeros(4)
        kl.mul_(2)
    assert "rd" in mine and g.report.events[0].placed_at is not None


def _rows(d: dict[str, torch.Tensor]) -> Iterator[None]:
    with kvguard.guard(d, name="d", action="record"):
        yield


def test_a_guard_held_by_a_dropped_generator_leaves_no_mode_behind() -> None:
    a = {"a": torch.zeros(3)}
    gen = _rows(a)
    next(gen)
    with kvguard.guard({"b": torch.zeros(3)}, name="b", action="record") as inner:
        del gen  # closes the generator: its guard exits while `inner` is innermost
        gc.collect()
        a["a"].add_(1)
    assert torch._C._len_torch_dispatch_stack() == 0
    assert inner.report.ok
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    assert not is_in_torch_dispatch_mode()


def test_a_guard_exited_under_a_users_dispatch_mode() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    rd = {"k": torch.ones(2)}
    g = kvguard.guard(rd, name="rd", action="record")
    g.__enter__()
    counting = Counting()
    counting.__enter__()
    g.__exit__(None, None, None)
    rd["k"].add_(1)  # the user's mode still sees ops; the guard does not
    assert Counting.calls >= 1 and g.report.ok
    counting.__exit__(None, None, None)
    assert torch._C._len_torch_dispatch_stack() == 0


# -- names ---------------------------------------------------------------------------------

class _Trainer:
    def __init__(self) -> None:
        self.rollout_data = {"kl": [torch.ones(2)]}

    def step(self) -> list[kvguard.MutationEvent]:
        with kvguard.guard(self.rollout_data, action="record") as g:
            self.rollout_data["kl"][0].mul_(2)
        return g.report.events


def test_the_default_name_is_the_expression_the_caller_wrote() -> None:
    assert _Trainer().step()[0].path == "self.rollout_data['kl'][0]"
    batch = {"rollout": {"kl": torch.ones(2)}}
    with kvguard.guard(batch["rollout"], action="record") as g:
        batch["rollout"]["kl"].add_(1)
    assert g.report.events[0].path == "batch[\"rollout\"]['kl']"
    with kvguard.guard(
        batch["rollout"],
        action="record",
    ) as g:
        batch["rollout"]["kl"].add_(1)
    assert g.report.events[0].path == "batch[\"rollout\"]['kl']"


def test_a_literal_falls_back_to_obj() -> None:
    x = torch.ones(2)
    with kvguard.guard({"x": x}, action="record") as g:
        x.add_(1)
    assert g.report.events[0].path == "obj['x']"


# -- a job that dies of a MutationError: the traceback ends at the user's line ------------------

def test_an_uncaught_error_traceback_ends_at_the_users_line(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, kvguard

        def shape(rd):
            for k in rd["kl"]:
                k *= 0.1

        rd = {"kl": [torch.ones(3)]}
        with kvguard.guard(rd):
            shape(rd)
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                            env={k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")})
    assert result.returncode == 1
    frames = [line.strip() for line in result.stderr.splitlines() if line.strip().startswith("File ")]
    assert frames[-1].startswith(f'File "{script}", line 6, in shape'), result.stderr
    assert not any("kvguard" in f.split('"')[1] or "torch" in f.split('"')[1] for f in frames), result.stderr
    assert "kvguard.MutationError: rd['kl'][0] would be modified in place by aten.mul_.Tensor" in result.stderr


@pytest.mark.every_engine
def test_a_guard_exited_on_another_thread_stops_acting(engine: str) -> None:
    import threading

    rd = {"k": torch.ones(2)}
    g = kvguard.guard(rd, name="rd", action="raise")
    g.__enter__()
    if g.engine != "mode":  # a write hook is process-wide: any thread detaches it
        worker = threading.Thread(target=g.__exit__, args=(None, None, None))
        worker.start()
        worker.join()
        rd["k"].add_(1)  # no longer guarded
        assert torch.equal(rd["k"], torch.full((2,), 2.0)) and g.report.ok
        return
    mode = torch._C._get_dispatch_stack_at(0)
    errors: list[BaseException] = []

    def leave() -> None:
        try:
            g.__exit__(None, None, None)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    worker = threading.Thread(target=leave)
    worker.start()
    worker.join()
    try:
        assert errors == []
        rd["k"].add_(1)  # the mode is still on this thread's stack, but inert
        assert torch.equal(rd["k"], torch.full((2,), 2.0)) and g.report.ok
    finally:
        assert torch._C._get_dispatch_stack_at(0) is mode  # unreachable from the other thread
        mode.__exit__(None, None, None)  # what only this thread can do
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    assert not is_in_torch_dispatch_mode()
