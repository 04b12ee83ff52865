"""Rank tags from Megatron-core's real `parallel_state`, on gloo, in fresh interpreters.

Megatron is imported only inside the subprocesses (it takes seconds and warns on import).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import textwrap

import pytest

# Found, not imported: importing megatron-core costs each collecting worker 5 CPU-seconds,
# and the tests import it only in their subprocesses.
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is in the ci extra (pip install -e .[ci])", allow_module_level=True)

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import kvguard
    from kvguard import _ranks

    def main(rank, world, cp, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        print(f"before init: [{_ranks.rank_tag()}]", flush=True)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from megatron.core import parallel_state
        print(f"imported, not initialised: [{_ranks.rank_tag()}]", flush=True)
        parallel_state.initialize_model_parallel(context_parallel_size=cp)
        rd = {"kl": [torch.ones(3)]}
        with kvguard.guard(rd, name="rd", action="record") as g:
            rd["kl"][0].mul_(2)
        print(f"initialised: [{_ranks.rank_tag()}] events={len(g.report.events)}", flush=True)
        parallel_state.destroy_model_parallel()
        print(f"destroyed: [{_ranks.rank_tag()}]", flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        world, cp, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
        if world == 1:
            main(0, 1, cp, port)
        else:
            import torch.multiprocessing as mp
            mp.spawn(main, args=(world, cp, port), nprocs=world)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, cp: int, tmp_path) -> str:  # type: ignore[no-untyped-def]
    script = tmp_path / "megatron_ranks.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "RANK", "WORLD_SIZE"))}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, str(script), str(world), str(cp), str(_free_port())],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_one_process_gets_megatron_tags_only_while_initialised(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = run(1, 1, tmp_path)
    assert "before init: []" in out
    assert "imported, not initialised: [rank 0/1]" in out
    assert "initialised: [rank 0/1 tp=0 pp=0 dp=0 cp=0] events=1" in out
    assert "destroyed: [rank 0/1]" in out


@pytest.mark.slow
def test_two_context_parallel_ranks_are_told_apart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = run(2, 2, tmp_path)
    assert "initialised: [rank 0/2 tp=0 pp=0 dp=0 cp=0] events=1" in out
    assert "initialised: [rank 1/2 tp=0 pp=0 dp=0 cp=1] events=1" in out


def test_importing_the_integration_never_imports_megatron() -> None:
    code = "import kvguard_megatron, sys; print(kvguard_megatron.rank_tags(), 'megatron' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.stdout.strip() == "{} False", out.stderr
