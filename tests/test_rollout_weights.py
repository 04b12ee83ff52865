"""`KVGUARD_TARGETS=weights` on the rollout engine's side (issue 37 items 1-2), in real subprocesses.

The jobs drive the replicas of vLLM 0.34.0, sglang 0.5.23 and verl's vLLM worker extension
(`tests/fake_frameworks/`: their module paths and signatures, CPU only; neither vLLM nor sglang
runs here) the way a rollout worker does, with no optimizer: weights received in buckets
through a reused buffer, loaded, then generation. Each scenario runs under each engine (the
quick run keeps one per test, as tests/conftest.py does). The in-process tests check the
pieces: which variables a frame may still read, which consumers keep what an iterator gives
them, when a load's write is a second one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from processes import free_port, run_python

import kvguard
from kvguard._protect import liveness, weights_loads
from kvguard._protect.frames import UNKNOWN_SITE

FAKE = Path(__file__).resolve().parent / "fake_frameworks"
JOBS = FAKE / "jobs"
ENGINES = ("compiled", "kernels", "mode")
ON = {"KVGUARD": "raise", "KVGUARD_TARGETS": "weights"}


@pytest.fixture(params=ENGINES)
def each_engine(request: pytest.FixtureRequest) -> str:
    """Run the job under each engine (tests/conftest.py keeps one per test in the quick run)."""
    from kvguard._engine import choice as _choice

    why = _choice.why_not(request.param)
    if why is not None:
        pytest.skip(f"the {request.param} engine is not available here: {why}")
    return str(request.param)


def job(name: str, *args: object, engine: str = "", **settings: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(FAKE), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200", **settings}
    if engine:
        env["KVGUARD_ENGINE"] = engine
    return run_python(JOBS / name, *args, timeout=300, **env)


def lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return result.stderr.strip().splitlines()


# -- the clean loops: silent, bitwise the same outputs ----------------------------------------


@pytest.mark.parametrize("shape", ["clean", "lazy_refill"])
def test_a_vllm_style_load_loop_is_silent_with_bitwise_equal_outputs(shape: str, each_engine: str) -> None:
    """20 steps of: receive each bucket into one reused buffer, load its views with vLLM's
    AutoWeightsLoader (`load_weights`), generate. `lazy_refill` refills the one region the view
    yielded last lies in while the loader's loop variables still reference it: no use."""
    plain = job("vllm_rollout.py", shape, 20)
    guarded = job("vllm_rollout.py", shape, 20, engine=each_engine, **ON)
    assert plain.returncode == 0 and guarded.returncode == 0, guarded.stderr[-3000:]
    assert guarded.stdout == plain.stdout and plain.stdout.startswith("digest ")
    buffers = "1 receive buffer"
    assert lines(guarded) == [
        "kvguard: weights: 15 parameters and buffers watched (no optimizer step), no in-place writes",
        f"kvguard: weights: 20 loads watched (load_weights), 300 tensors handed to them protected until consumed, "
        f"{buffers} watched for refills"]


@pytest.mark.parametrize("script, shape", [("sglang_rollout.py", "direct"), ("sglang_rollout.py", "flattened"),
                                           ("verl_rollout.py", "clean"), ("vllm_rollout.py", "reload_fixed")])
def test_the_frameworks_weight_updates_are_silent(script: str, shape: str, each_engine: str) -> None:
    """sglang's `update_weights_from_tensor` (`direct`: no load_weights at all; `flattened_bucket`:
    views of one flat tensor), verl's `update_weights_from_ipc` (clones out of the trainer's
    buffer), vLLM's layerwise reload with the fix: each a load, silent, outputs unchanged."""
    plain = job(script, shape)
    guarded = job(script, shape, engine=each_engine, **ON)
    assert plain.returncode == 0 and guarded.returncode == 0, guarded.stderr[-3000:]
    assert guarded.stdout == plain.stdout
    assert "no in-place writes" in lines(guarded)[0]
    assert "loads watched" in guarded.stderr


def test_a_post_load_transform_by_design_is_an_intended_writer(each_engine: str) -> None:
    """vLLM's `finalize_model_weights` runs each module's post-load hook after a kernel-format reload:
    a hook rounding lm_head's weight in place writes what the reload just wrote, by design."""
    result = job("vllm_rollout.py", "kernel_format", engine=each_engine, **ON)
    assert result.returncode == 0, result.stderr[-3000:]
    assert lines(result)[:2] == [
        "kvguard: weights: 15 parameters and buffers watched (no optimizer step), no in-place writes, 2 allowed",
        "  allowed: 2 writes by intended writer vLLM post-load transform"]


# -- what it catches, at the line -------------------------------------------------------------


def test_a_stray_write_to_loaded_weights_is_stopped_naming_the_load(each_engine: str) -> None:
    result = job("vllm_rollout.py", "stray", engine=each_engine, **ON)
    assert result.returncode == 1 and "digest" not in result.stdout
    err = result.stderr
    assert ("kvguard.MutationError: rollout_model.lm_head.weight would be modified in place by aten.mul_.Tensor "
            "at vllm_rollout.py:") in err
    assert "  placed   vllm_rollout.py:" in err and "(loaded by rollout_model.load_weights)" in err
    assert "kvguard/_" not in err.split("Traceback", 1)[1].split("kvguard.MutationError")[0]  # ends at the user's line


@pytest.mark.parametrize("script", ["sglang_rollout.py", "verl_rollout.py"])
def test_a_stray_write_after_a_frameworks_update_names_it(script: str, each_engine: str) -> None:
    result = job(script, "stray", engine=each_engine, **ON)
    assert result.returncode == 1
    loaded_by = "update_weights_from_tensor" if script.startswith("sglang") else "update_weights_from_ipc"
    assert f"(loaded by {loaded_by})" in result.stderr
    assert "would be modified in place by" in result.stderr


def test_a_layerwise_reload_that_restores_a_stale_view_is_written_twice(each_engine: str) -> None:
    """vLLM's layerwise reload before the fix copied back a non-persistent buffer that views a
    weight, holding its value from before the reload, over the weight just copied in."""
    result = job("vllm_rollout.py", "reload_restore", engine=each_engine, **ON)
    assert result.returncode == 1
    err = result.stderr
    assert ("kvguard.MutationError: rollout_model.lm_head.weight (the same memory as rollout_model.lm_head.weight_t) "
            "would be written a second time in one load by aten.copy_.default at layerwise.py:") in err
    assert "  load     rollout_model.finish_reload at vllm_rollout.py:" in err
    assert "wrote these elements already (at layerwise.py:" in err
    assert "action   raised before the write; the data is intact" in err


@pytest.mark.parametrize("shape", ["collect", "stash"])
def test_a_load_that_keeps_its_weights_while_the_buffer_is_refilled(shape: str, each_engine: str) -> None:
    """`dict(weights)` keeps every view it takes, and so does a loop stashing each in a dict: the
    generator's next refill overwrites them."""
    result = job("vllm_rollout.py", shape, engine=each_engine, **ON)
    assert result.returncode == 1
    err = result.stderr
    assert ("kvguard.MutationError: rollout_model.load_weights['model.embed_tokens.weight'] would be modified in "
            "place by aten.copy_.default at vllm_rollout.py:") in err
    assert "(handed to rollout_model.load_weights at vllm_rollout.py:" in err
    assert "what a load is handed is the sender's until the load has consumed it" in err


@pytest.mark.parametrize("shape, op", [("kept_views", "aten.copy_.default"),
                                       ("all_gather", "c10d._allgather_base_.default")])
def test_views_held_when_the_receive_buffer_is_refilled(shape: str, op: str, each_engine: str) -> None:
    """A receive that keeps views of the reused buffer for the load after the last bucket (no
    clone): the next bucket lands on them. By `copy_` the buffer is known from the first load that
    took views of it (the second step); by a receiving collective, from its first receive."""
    args = (shape, 3, free_port()) if shape == "all_gather" else (shape,)
    result = job("vllm_rollout.py", *args, engine=each_engine, PYTHONWARNINGS="ignore", **ON)
    assert result.returncode == 1
    err = result.stderr
    assert f"kvguard.MutationError: pending['model.embed_tokens.weight'] would be modified in place by {op} at " \
           "vllm_rollout.py:" in err
    receive = "dist.all_gather_single at vllm_rollout.py:" if shape == "all_gather" else \
        "views of it handed to rollout_model.load_weights at vllm_rollout.py:"
    assert "(a view of the receive buffer: " + receive in err
    assert "a view of a receive buffer changes when the buffer is refilled" in err


@pytest.mark.slow  # two gloo processes: CI runs it (-m slow)
def test_views_of_a_broadcast_buffer_held_past_the_next_broadcast_on_two_gloo_processes() -> None:
    result = job("rollout_broadcast.py", free_port(), "kept_views", KVGUARD="warn", KVGUARD_TARGETS="weights",
                 PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pending['lora_A'] was modified in place by c10d.broadcast_.default at rollout_broadcast.py:27" \
        in result.stderr
    assert "rollout_broadcast.py:28 (a view of the receive buffer: dist.broadcast at rollout_broadcast.py:27)" \
        in result.stderr


@pytest.mark.slow  # two gloo processes: CI runs it (-m slow)
def test_sglangs_distributed_update_is_silent_on_two_gloo_processes() -> None:
    result = job("rollout_broadcast.py", free_port(), "sglang", KVGUARD="raise", KVGUARD_TARGETS="weights",
                 PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 1 steps done" in result.stdout
    assert "3 loads watched (load_weights_from_distributed), 12 tensors handed to them" in result.stderr


def test_a_cuda_ipc_rebuild_makes_a_receive_buffer(tmp_path: Path) -> None:
    """What `rebuild_cuda_tensor` returns is a receive buffer (no GPU here: the wrapper is given a
    stand-in for the rebuild, as activation wraps torch's)."""
    script = tmp_path / "ipc.py"
    script.write_text(textwrap.dedent("""
        import torch
        from kvguard._activate import weights_loads, weights_receives

        shared = torch.zeros(16)
        rebuild = weights_receives._ipc(lambda *args: shared, weights_loads._settings[0])
        buffer = rebuild()                     # as verl's rebuild_ipc(handle) calls func(*args)
        pending = {"lora_A": buffer[:8]}       # kept, no clone
        buffer.copy_(torch.ones(16))           # the next bucket
        print(pending)
    """))
    result = run_python(script, **ON)
    assert result.returncode == 1
    assert "pending['lora_A'] would be modified in place by aten.copy_.default at ipc.py:9" in result.stderr
    assert "(a view of the receive buffer: a CUDA IPC rebuild at ipc.py:7)" in result.stderr


def test_a_trainers_collectives_are_not_receives(tmp_path: Path) -> None:
    """A process that made an optimizer is a trainer: its broadcasts are its own business."""
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = torch.empty(4)
        for _ in range(2):
            dist.all_gather_single(out, torch.ones(4))
            kept = out[:2]
        dist.destroy_process_group()
    """))
    result = run_python(script, PYTHONWARNINGS="ignore", **ON)
    assert result.returncode == 0, result.stderr
    assert "receive buffer" not in result.stderr


@pytest.mark.parametrize("stash", [False, True])
def test_a_long_load_frees_what_it_consumed_and_still_finds_what_it_keeps(tmp_path: Path, stash: bool) -> None:
    """200 views of one 16-row buffer, handed one at a time to a `for` loop that frees each as it
    moves on: their entries leave the memory index in batches (`_PURGE`), not one rebuild each. A
    view the loop keeps in a dict it returns stays protected through those batches: the refill
    that lands on it 16 items later is reported."""
    script = tmp_path / "long_load.py"
    script.write_text(textwrap.dedent(f"""
        import torch

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(200, 4))

            def load_weights(self, weights):
                kept = {{}}
                for name, t in weights:
                    self.w.data[int(name)].copy_(t)
                    if {stash} and name == "150":
                        kept[name] = t
                return kept

        buffer = torch.empty(64)
        sent = torch.arange(800.0).view(200, 4)

        def stream():
            for i in range(200):
                slot = i % 16 * 4
                buffer[slot:slot + 4].copy_(sent[i])
                yield str(i), buffer[slot:slot + 4]

        model = Model()
        for _ in range(2):
            model.load_weights(stream())
        print(bool(torch.equal(model.w, sent)))
    """))
    result = run_python(script, **ON)
    if not stash:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "True"
        assert "400 tensors handed to them protected until consumed, 1 receive buffer watched" in result.stderr
        return
    assert result.returncode == 1
    assert "kvguard.MutationError: model.load_weights['150'] would be modified in place by aten.copy_.default " \
           "at long_load.py:23" in result.stderr
    assert "placed   long_load.py:24 (handed to model.load_weights at long_load.py:28)" in result.stderr


# -- the pieces, in-process --------------------------------------------------------------------


def _live_here() -> frozenset[str]:
    names = liveness.live_names(sys._getframe(1))
    assert names is not None
    return names


def test_a_finished_loop_variable_is_dead_and_what_is_read_later_is_live() -> None:
    def probe(weights: list[tuple[str, int]]) -> list[frozenset[str]]:
        found: list[frozenset[str]] = []
        pending: dict[str, int] = {}
        for name, w in weights:  # `name` and `w` are rebound by the next iteration before any read
            found.append(_live_here())
        found.append(_live_here())  # after the loop: `w` still holds the last item, and is never read
        x = 1
        found.append(_live_here())
        pending["x"] = x
        return found

    in_loop, after_loop, before_use = probe([("a", 1), ("b", 2)])[1:]  # the second iteration's, then the rest
    assert "w" not in in_loop and "name" not in in_loop and "pending" in in_loop
    assert "w" not in after_loop and "pending" in after_loop
    assert "x" in before_use and "pending" in before_use


def test_a_module_frame_counts_the_globals_its_functions_read(tmp_path: Path) -> None:
    code = compile(textwrap.dedent("""
        import sys
        from kvguard._protect import liveness
        for item in range(2):
            pass
        kept = [1]
        def later():
            return kept
        live = liveness.live_names(sys._getframe(0))
    """), str(tmp_path / "m.py"), "exec")
    namespace: dict[str, object] = {}
    exec(code, namespace)
    live = namespace["live"]
    assert isinstance(live, frozenset) and "kept" in live and "item" not in live


def test_collectors_keep_what_they_take_and_loops_do_not() -> None:
    seen: list[bool] = []

    class Probe:
        def __init__(self) -> None:
            self.items = iter([1, 2])

        def __iter__(self) -> Probe:
            return self

        def __next__(self) -> int:
            caller = sys._getframe(1)
            seen.append(liveness.collects(caller, lambda: liveness.callee(caller) in liveness.COLLECTORS))
            return next(self.items)

    probe = Probe()
    for _ in probe:
        pass
    assert not any(seen)
    seen.clear()
    probe = Probe()
    list(probe)
    assert all(seen) and seen
    seen.clear()
    probe = Probe()
    _ = [x for x in probe]
    assert all(seen) and seen
    seen.clear()
    made = {"probe": Probe()}
    _ = dict(zip(made["probe"], "ab"))  # a collector whose argument is a call: zip hands each on to dict
    assert all(seen) and seen
    seen.clear()
    _ = sorted(iter(Probe()))
    assert all(seen) and seen


def test_a_second_write_is_one_to_elements_the_load_wrote_already() -> None:
    qkv = torch.zeros(6, 4)
    load = weights_loads.Load("model.load_weights", UNKNOWN_SITE, None)
    assert load.wrote([qkv[0:2]], "a.py:1") is None  # q, k and v: three disjoint row blocks
    assert load.wrote([qkv[2:4]], "a.py:2") is None
    assert load.wrote([qkv[4:6]], "a.py:3") is None
    assert load.wrote([qkv[:, 0]], "a.py:4") == "a.py:1"  # a column meets every block
    cols = weights_loads.Load("model.load_weights", UNKNOWN_SITE, None)
    assert cols.wrote([qkv[:, 0:2]], "b.py:1") is None  # column shards: strided, disjoint
    assert cols.wrote([qkv[:, 2:4]], "b.py:2") is None
    assert cols.wrote([qkv.view(-1)[1:2]], "b.py:3") == "b.py:1"


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_load_state_dict_twice_is_one_load_each_and_a_tied_weight_is_written_once_per_name(engine: str) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(state) == 2  # one tensor under two names
    with kvguard.guard_module(model, action="record") as g:
        model.load_state_dict(state)
        model.load_state_dict(state)
    assert g.report.ok, g.report.format()


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_a_state_dict_holding_a_weight_and_a_view_of_it_writes_it_twice(engine: str) -> None:
    """A persistent buffer that views a weight, in the state dict beside it: the load writes the
    weight's elements twice, the buffer's value last (prime-rl #2482's stale buffer, inside a load)."""
    model = torch.nn.Linear(4, 2)
    model.register_buffer("packed", model.weight.data.view(8))
    with kvguard.guard_module(model, action="record") as g:
        model.load_state_dict({"weight": torch.ones(2, 4), "bias": torch.zeros(2), "packed": torch.zeros(8)})
    kinds = {(e.path, e.kind) for e in g.report.events}  # the write reaches both names of the memory
    assert kinds == {("model.weight", "written_twice"), ("model.packed", "written_twice")}, g.report.format()
    assert "Linear.load_state_dict at test_rollout_weights.py:" in g.report.events[0].diff
