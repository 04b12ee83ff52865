"""What `guard_autograd` costs per saved tensor on real models' training steps, in one process.

transformers GPT-2, Llama, BERT, T5 and Mixtral (timm EfficientNet when installed) from tiny
configs with random weights, one torch thread. Each round runs a forward + backward step
plainly and under `kvguard.guard_autograd(action="raise")`, in an order that rotates with
the round; CPU time of the step inside the guard (entering and leaving it are timed apart:
`KVGUARD_TARGETS=autograd` enters it once per process), medians over rounds. The figure to
read is (guarded - plain) / saved tensors per step, in µs; beside it, what an empty pair of
`saved_tensors_hooks` (Python identities) costs the same way: autograd's own price of letting
any hook see saved tensors, which kvguard's C hooks cannot go below.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_autograd_real.py                 # ~2 min
    PYTHONPATH=. .venv/bin/python benchmarks/bench_autograd_real.py --models gpt2 --rounds 5
    PYTHONPATH=. .venv/bin/python benchmarks/bench_autograd_real.py --profile llama  # cProfile, guarded steps

The benchmark of record (fresh processes, env activation, both targets) is
`bench_real_models.py`; this one isolates the autograd target and is quick to rerun.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from typing import Any, Callable

import torch

import kvguard

MODELS = ["gpt2", "llama", "bert", "t5", "mixtral", "efficientnet"]


def build(name: str) -> Callable[[], Any] | None:
    """A forward + backward step of a tiny model, or None when its library is missing."""
    torch.manual_seed(0)
    vocab, batch, seq = 256, 4, 64
    ids = torch.randint(0, vocab, (batch, seq))
    data: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
    try:
        if name == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel
            model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=4))
        elif name == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM
            model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 attn_implementation="sdpa"))
        elif name == "mixtral":
            from transformers import MixtralConfig, MixtralForCausalLM
            model = MixtralForCausalLM(MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2, num_local_experts=4,
                                                     num_experts_per_tok=2))
        elif name == "bert":
            from transformers import BertConfig, BertForMaskedLM
            model = BertForMaskedLM(BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=128,
                                               max_position_embeddings=seq))
        elif name == "t5":
            from transformers import T5Config, T5ForConditionalGeneration
            model = T5ForConditionalGeneration(T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128,
                                                        num_layers=2, num_decoder_layers=2, num_heads=4,
                                                        decoder_start_token_id=0))
            data = {"input_ids": ids, "labels": torch.randint(1, vocab, (batch, seq // 2))}
        elif name == "efficientnet":
            import timm
            model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)
            images, classes = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
            model.train()

            def vision() -> None:
                torch.nn.functional.cross_entropy(model(images), classes).backward()
                model.zero_grad(set_to_none=True)
            return vision
        else:
            raise SystemExit(f"unknown model {name!r}")
    except ImportError:
        return None
    model.train()

    def lm() -> None:
        model(**data).loss.backward()
        model.zero_grad(set_to_none=True)
    return lm


def count_saved(step: Callable[[], Any]) -> int:
    n = [0]

    def pack(t: Any) -> Any:
        n[0] += 1
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return n[0]


def measure(name: str, step: Callable[[], Any], rounds: int) -> dict[str, float]:
    contexts: dict[str, Callable[[], Any]] = {
        "plain": nullcontext,
        "guarded": lambda: kvguard.guard_autograd(action="raise"),
        # the floor of seeing saved tensors at all: autograd's hook machinery, no work in the hooks
        "hooks": lambda: torch.autograd.graph.saved_tensors_hooks(_same, _same),
    }
    names = list(contexts)
    times: dict[str, list[float]] = {k: [] for k in names}
    for k in names:  # warm-up
        for _ in range(2):
            with contexts[k]():
                step()
    edges: list[float] = []  # entering and leaving the guard
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()
            outer = time.process_time()
            with contexts[k]():
                start = time.process_time()
                step()
                inner = time.process_time() - start
            times[k].append(inner)
            if k == "guarded":
                edges.append(time.process_time() - outer - inner)
    saved = count_saved(step)
    plain, guarded = statistics.median(times["plain"]), statistics.median(times["guarded"])
    hooks = statistics.median(times["hooks"])
    return {"saved": saved, "plain": plain, "guarded": guarded, "per": (guarded - plain) / saved,
            "hooks": (hooks - plain) / saved, "edges": statistics.median(edges)}


def _same(t: Any) -> Any:
    return t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--profile", default="")
    args = parser.parse_args()
    os.environ.setdefault("KVGUARD_ENGINE", "compiled")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if args.profile:
        import cProfile
        import pstats
        step = build(args.profile)
        assert step is not None
        for _ in range(2):
            with kvguard.guard_autograd():
                step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.rounds):
            with kvguard.guard_autograd():
                step()
        prof.disable()
        pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("ROWS", "25")))
        return
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, kvguard from {os.path.dirname(kvguard.__file__)}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"{args.rounds} rounds, CPU time, one thread, forward + backward")
    print("| model | saved/step | plain ms | guard_autograd ms | ratio | µs per saved tensor | empty hooks µs | "
          "enter + exit ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        step = build(name)
        if step is None:
            print(f"| {name} | (not installed) | | | | | | |")
            continue
        m = measure(name, step, args.rounds)
        print(f"| {name} | {m['saved']} | {m['plain'] * 1e3:.2f} | {m['guarded'] * 1e3:.2f} | "
              f"{m['guarded'] / m['plain']:.2f} | {m['per'] * 1e6:.1f} | {m['hooks'] * 1e6:.1f} | "
              f"{m['edges'] * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
