"""The benchmark of record: what `KVGUARD_TARGETS=autograd,weights` costs on real models' training steps.

Real libraries' models, built from tiny configs with random weights (no download), trained for
a few steps each, one torch thread, CPU:

    gpt2            transformers GPT-2, AdamW (torch's default on CPU: the for-loop form)
    llama           transformers Llama (sdpa attention), AdamW
    llama-foreach   the same, AdamW(foreach=True)
    gpt2-sgd-loop   GPT-2, SGD with momentum, foreach=False (the for-loop form, named)
    bert            transformers BERT, masked-LM loss, AdamW
    t5              transformers T5 (encoder-decoder), AdamW
    mixtral         transformers Mixtral (mixture of experts), AdamW
    efficientnet    timm EfficientNet-B0, AdamW
    convnext        timm ConvNeXt-Atto under bf16 autocast, AdamW
    trl-grpo        trl's GRPOTrainer, its own training loop (generation, reward, loss, step)

Each configuration runs in fresh processes, one per contender, switched on from the
environment as a user would (`KVGUARD=raise KVGUARD_TARGETS=autograd,weights python train.py`):

    plain           no KVGUARD variable
    raise           KVGUARD=raise KVGUARD_TARGETS=autograd,weights
    warn            KVGUARD=warn  KVGUARD_TARGETS=autograd,weights
    autograd        KVGUARD=raise KVGUARD_TARGETS=autograd
    weights         KVGUARD=raise KVGUARD_TARGETS=weights
    all             KVGUARD=raise KVGUARD_TARGETS=all (every kind and preset: autograd, weights, data)
    sampled         the same with KVGUARD_SAMPLE=1/100 (the first 3 step intervals are always checked:
                    after the warm-up steps a timed step is checked 1 time in 100)
    plain-again     no KVGUARD variable, a second plain process: its ratio to plain is what two
                    identical processes differ by here, the table's resolution (read a sampled
                    cell against it)

Inside each process the step's CPU time (`time.process_time`) is taken per step after
warm-up steps, and the process reports the median. A round runs every configuration's
contenders once, in an order that rotates with the round, so contenders see the same load;
a configuration's figure is the median over rounds of (contender's median step / plain's
median step in that round). The plain process also counts the tensors autograd saves per step
(one extra step, after the timed ones), so the autograd column can be read per saved tensor.
Numerics: every contender's per-step losses must be bitwise equal to plain's (same seeds).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_real_models.py                  # all, 5 rounds
    PYTHONPATH=. .venv/bin/python benchmarks/bench_real_models.py --quick          # gpt2 + llama, 1 round
    PYTHONPATH=. .venv/bin/python benchmarks/bench_real_models.py --configs bert,t5 --rounds 3
    PYTHONPATH=. .venv/bin/python benchmarks/bench_real_models.py --profile llama --targets autograd

Needs an installed kvguard (its `kvguard.pth`: `pip install -e .` or `python -m kvguard
install-pth`), transformers, timm (and so torchvision) and trl; a configuration whose
library is missing is left out with a line saying so. torchvision's only wheel for torch
2.13 here is a CUDA build that cannot load on CPU torch: the child defines the two operator
schemas its import needs when that happens (it uses none of them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from kvguard import _config

CONFIGS = ["gpt2", "llama", "llama-foreach", "gpt2-sgd-loop", "bert", "t5", "mixtral", "efficientnet", "convnext",
           "trl-grpo"]
QUICK = ["gpt2", "llama"]
CONTENDERS: dict[str, tuple[str, str, dict[str, str]] | None] = {
    "plain": None,
    "raise": ("raise", "autograd,weights", {}),
    "warn": ("warn", "autograd,weights", {}),
    "autograd": ("raise", "autograd", {}),
    "weights": ("raise", "weights", {}),
    "all": ("raise", "all", {}),
    "sampled": ("raise", "all", {"KVGUARD_SAMPLE": "1/100"}),
    "plain-again": ("0", "", {}),  # KVGUARD=0: off, as unset
}
DESCRIPTIONS = {
    "gpt2": "transformers GPT-2, AdamW",
    "llama": "transformers Llama (sdpa), AdamW",
    "llama-foreach": "transformers Llama, AdamW foreach",
    "gpt2-sgd-loop": "transformers GPT-2, SGD momentum for-loop",
    "bert": "transformers BERT (MLM), AdamW",
    "t5": "transformers T5, AdamW",
    "mixtral": "transformers Mixtral (MoE), AdamW",
    "efficientnet": "timm EfficientNet-B0, AdamW",
    "convnext": "timm ConvNeXt-Atto, bf16 autocast, AdamW",
    "trl-grpo": "trl GRPOTrainer step",
}
WARMUP, STEPS = 3, 8  # per process: untimed steps, then timed steps
MISSING = 3  # a child's exit status when its library is not installed


# ── the child: one configuration, one contender ─────────────────────────────────────────────

def _torchvision_importable() -> None:
    """Make `import torchvision` work where its wheel is a CUDA build on CPU torch (timm needs it)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision
    except Exception:  # noqa: BLE001 - its _C.so did not load: define the ops its import registers
        import torch

        for name in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
        _keep.append(lib)
        import torchvision  # noqa: F401


_keep: list[Any] = []


def _lm_batch(torch: Any, vocab: int, batch: int, seq: int) -> dict[str, Any]:
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": ids.clone()}


def _build(config: str) -> tuple[Any, Any, Callable[[], Any]]:
    """(model, optimizer, step) for a configuration; `step()` runs one training step and returns the loss."""
    import torch

    torch.manual_seed(0)
    vocab, batch, seq = 256, 4, 64
    if config in ("gpt2", "gpt2-sgd-loop"):
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=4))
        data = _lm_batch(torch, vocab, batch, seq)
    elif config in ("llama", "llama-foreach"):
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             attn_implementation="sdpa"))
        data = _lm_batch(torch, vocab, batch, seq)
    elif config == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 num_local_experts=4, num_experts_per_tok=2))
        data = _lm_batch(torch, vocab, batch, seq)
    elif config == "bert":
        from transformers import BertConfig, BertForMaskedLM

        model = BertForMaskedLM(BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=128, max_position_embeddings=seq))
        ids = torch.randint(5, vocab, (batch, seq))
        labels = torch.full_like(ids, -100)
        masked = torch.rand(batch, seq) < 0.15
        labels[masked] = ids[masked]
        ids = ids.masked_fill(masked, 4)  # the [MASK] token
        data = {"input_ids": ids, "labels": labels}
    elif config == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        model = T5ForConditionalGeneration(T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                    num_decoder_layers=2, num_heads=4, decoder_start_token_id=0))
        data = {"input_ids": torch.randint(1, vocab, (batch, seq)), "labels": torch.randint(1, vocab, (batch, seq // 2))}
    elif config in ("efficientnet", "convnext"):
        _torchvision_importable()
        import timm

        name = {"efficientnet": "efficientnet_b0", "convnext": "convnext_atto"}[config]
        model = timm.create_model(name, pretrained=False, num_classes=10)
        batch = 2 if config == "convnext" else 4  # bf16 convolutions are slow on CPUs without AMX
        images, classes = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        bf16 = config == "convnext"

        def vision_step() -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = torch.nn.functional.cross_entropy(model(images), classes)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return model, opt, vision_step
    else:
        raise SystemExit(f"unknown configuration {config!r}")
    model.train()
    if config == "llama-foreach":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    elif config == "gpt2-sgd-loop":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def lm_step() -> Any:
        loss = model(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, opt, lm_step


def _count_saved(torch: Any, step: Callable[[], Any]) -> int:
    count = [0]

    def pack(t: Any) -> Any:
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return count[0]


def _run_trl(steps: int, profile: Any) -> dict[str, Any]:
    """trl's GRPOTrainer on a tiny Llama, its own loop; each step generates, rewards, and trains once."""
    import tempfile

    import datasets
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        TrainerCallback,
    )
    from trl import GRPOConfig, GRPOTrainer

    words = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz"]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    datasets.disable_progress_bars()
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(words), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None))
    prompts = datasets.Dataset.from_dict({"prompt": ["a b c d", "e f g h", "i j k l", "m n o p"] * 16})

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [sum(c in "aeiou" for c in text.split()) / max(len(text.split()), 1) for text in completions]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        num_iterations=1, beta=0.0, max_steps=WARMUP + steps, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0, data_seed=0)
    times: list[float] = []

    class Clock(TrainerCallback):
        start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == WARMUP and profile is not None:
                profile.enable()
            self.start = time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step > WARMUP:
                times.append(time.process_time() - self.start)

    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward, args=args, train_dataset=prompts,
                          callbacks=[Clock()])
    trainer.train()
    if profile is not None:
        profile.disable()
    losses = [float(e["loss"]).hex() for e in trainer.state.log_history if "loss" in e]
    return {"times": times, "losses": losses, "params": sum(1 for _ in trainer.model.parameters()), "saved": None}


def child(config: str, steps: int, count_saved: bool, profile_out: str | None) -> None:
    _torchvision_importable()  # before transformers (which imports torchvision when it is installed)
    import torch

    torch.set_num_threads(1)
    profile = None
    if profile_out:
        import cProfile

        profile = cProfile.Profile()
    try:
        if config == "trl-grpo":
            out = _run_trl(steps, profile)
        else:
            model, _, step = _build(config)
            losses, times = [], []
            for i in range(WARMUP + steps):
                if i == WARMUP and profile is not None:
                    profile.enable()
                start = time.process_time()
                loss = step()
                elapsed = time.process_time() - start
                losses.append(loss.float().item().hex())
                if i >= WARMUP:
                    times.append(elapsed)
            if profile is not None:
                profile.disable()
            out = {"times": times, "losses": losses, "params": sum(1 for _ in model.parameters()),
                   "saved": _count_saved(torch, step) if count_saved else None}
    except ImportError as exc:
        print(f"missing: {exc}", file=sys.stderr)
        raise SystemExit(MISSING)
    from kvguard._state import STATE

    out["active"] = sorted(STATE.kinds)  # the process-wide kinds env activation entered
    if profile is not None:
        profile.dump_stats(profile_out)
    print("RESULT " + json.dumps(out))


# ── the parent: rounds of fresh processes ───────────────────────────────────────────────────

VISION_PATH: list[str] = []  # --vision-path: on the children's path for the timm configurations only


def _env(contender: str, config: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD") or k in ("KVGUARD_CACHE_DIR",
                                                                                         "KVGUARD_ENGINE")}
    if VISION_PATH and config in ("efficientnet", "convnext"):
        env["PYTHONPATH"] = os.pathsep.join(VISION_PATH + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore")
    setting = CONTENDERS[contender]
    if setting is not None:
        env.update(KVGUARD=setting[0], KVGUARD_TARGETS=setting[1], **setting[2])
    return env


def _result(config: str, contender: str, rc: int, stdout: str, stderr: str) -> dict[str, Any] | None:
    if rc == MISSING:
        return None
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if rc != 0 or not lines:
        raise RuntimeError(f"{config} / {contender} failed (exit {rc}):\n{stderr[-4000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    setting = CONTENDERS[contender]
    wanted = sorted(_config.named_kinds(setting[1])) if setting else []
    if sorted(out["active"]) != wanted:
        raise RuntimeError(f"{config} / {contender}: env activation entered {out['active']}, not {wanted}: "
                           "is kvguard installed (its kvguard.pth)? `python -m kvguard install-pth`\n" + stderr[-2000:])
    # what the guard reported: its exit lines say "no in-place writes" when it found none
    exits = [line for line in stderr.splitlines() if line.startswith(("kvguard: autograd:", "kvguard: weights:",
                                                                        "kvguard: data:"))]
    out["reports"] = sum(1 for line in exits if "no in-place writes" not in line and "no write was checked" not in line
                         ) + stderr.count("╭─ kvguard")
    out["stderr"] = stderr
    return out


def spawn(config: str, contender: str, steps: int, count_saved: bool = False,
          profile_out: str | None = None) -> dict[str, Any] | None:
    """One new interpreter (`--exec`, and `--profile`); its result, or None when its library is missing."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--steps", str(steps)]
    if count_saved:
        cmd.append("--count-saved")
    if profile_out:
        cmd += ["--profile-out", profile_out]
    proc = subprocess.run(cmd, env=_env(contender, config), capture_output=True, text=True, check=False)
    return _result(config, contender, proc.returncode, proc.stdout, proc.stderr)


class Zygote:
    """A process started with a contender's environment (so env activation ran at its start-up, as
    a user's job's does) that imports torch and the libraries once, then forks a new process per
    run: each run is a fresh process, without paying 10 CPU-seconds of imports every time."""

    def __init__(self, contender: str, configs: list[str]) -> None:
        import tempfile

        self.contender = contender
        env = _env(contender)
        if VISION_PATH:
            env["PYTHONPATH"] = os.pathsep.join(VISION_PATH + [p for p in [env.get("PYTHONPATH")] if p])
        self.log = tempfile.NamedTemporaryFile("a+", prefix=f"bench-real-{contender}-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--zygote", "--configs", ",".join(configs)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def ready(self) -> Zygote:
        self._read()  # READY: its imports are done
        return self

    def _read(self) -> tuple[int, str]:
        assert self.proc.stdout is not None
        lines = []
        for line in self.proc.stdout:
            if line.startswith(("DONE ", "READY")):
                return int(line.split()[1]) if line.startswith("DONE ") else 0, "".join(lines)
            lines.append(line)
        self.log.seek(0)
        raise RuntimeError(f"the {self.contender} process ended:\n{self.log.read()[-4000:]}")

    def run(self, config: str, steps: int, count_saved: bool = False) -> dict[str, Any] | None:
        assert self.proc.stdin is not None
        self.log.seek(0, 2)
        start = self.log.tell()
        self.proc.stdin.write(json.dumps({"config": config, "steps": steps, "count_saved": count_saved}) + "\n")
        self.proc.stdin.flush()
        rc, stdout = self._read()
        self.log.seek(start)
        return _result(config, self.contender, rc, stdout, self.log.read())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def zygote(configs: list[str]) -> None:
    """The server side of `Zygote`: import what `configs` need, then fork one child per request line."""
    import atexit
    import traceback

    _torchvision_importable()
    import torch

    torch.set_num_threads(1)
    vision = {"efficientnet", "convnext"} & set(configs)
    classes = {"gpt2": "GPT2LMHeadModel", "gpt2-sgd-loop": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
               "llama-foreach": "LlamaForCausalLM", "bert": "BertForMaskedLM", "t5": "T5ForConditionalGeneration",
               "mixtral": "MixtralForCausalLM", "trl-grpo": "LlamaForCausalLM"}
    try:  # transformers imports its model modules lazily
        import transformers

        for config in configs:
            if config in classes:
                getattr(transformers, classes[config])
        if vision:
            import timm  # noqa: F401
        if "trl-grpo" in configs:
            import datasets  # noqa: F401
            import tokenizers  # noqa: F401
            from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except ImportError:
        pass
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child(request["config"], request["steps"], request["count_saved"], None)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 1
            try:
                atexit._run_exitfuncs()  # kvguard's exit lines, as at a process's end
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"DONE {os.waitstatus_to_exitcode(status)}", flush=True)


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def measure(configs: list[str], contenders: list[str], rounds: int, steps: int, fork: bool) -> None:
    results: dict[str, dict[str, list[dict[str, Any]]]] = {c: {k: [] for k in contenders} for c in configs}
    missing: set[str] = set()
    loads = [load_average()]
    wall = time.time()
    zygotes = {k: Zygote(k, configs) for k in contenders} if fork else {}  # their imports run side by side
    for z in zygotes.values():
        z.ready()
    for r in range(rounds):
        for i, config in enumerate(configs):
            if config in missing:
                continue
            shift = (r + i) % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                count = contender == "plain" and r == 0
                out = (zygotes[contender].run(config, steps, count) if fork
                       else spawn(config, contender, steps, count_saved=count))
                if out is None:
                    missing.add(config)
                    print(f"{config}: left out, its library is not installed", file=sys.stderr)
                    break
                results[config][contender].append(out)
        loads.append(load_average())
        print(f"round {r + 1}/{rounds} done, {time.time() - wall:.0f} s, load {loads[-1]}", file=sys.stderr)
    for z in zygotes.values():
        z.close()
    report(configs, contenders, results, missing, rounds, steps, loads, fork)


def report(configs: list[str], contenders: list[str], results: dict[str, dict[str, list[dict[str, Any]]]],
           missing: set[str], rounds: int, steps: int, loads: list[str], fork: bool) -> None:
    guarded = [k for k in contenders if k != "plain"]
    head = ["configuration", "params", "saved/step", "plain ms/step"] + [f"{k}" for k in guarded] + [
        "µs/saved (autograd)", "losses bitwise"]
    how = "forked from a process per contender started with its environment" if fork else "a new interpreter each"
    print(f"\n{rounds} rounds × {steps} timed steps after {WARMUP} warm-up, a fresh process per configuration and "
          f"contender ({how}), one torch thread; ratio = median over rounds of (median step / plain's median step)\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    figures: dict[str, list[float]] = {k: [] for k in guarded}
    notes: list[str] = []
    for config in configs:
        if config in missing:
            continue
        runs = results[config]
        plain = [statistics.median(o["times"]) for o in runs["plain"]]
        row = [DESCRIPTIONS.get(config, config), str(runs["plain"][0]["params"]),
               str(runs["plain"][0]["saved"] if runs["plain"][0]["saved"] is not None else "—"),
               f"{statistics.median(plain) * 1e3:.1f}"]
        same = True
        for k in guarded:
            ratios = [statistics.median(o["times"]) / p for o, p in zip(runs[k], plain)]
            ratio = statistics.median(ratios)
            figures[k].append(ratio)
            spread = f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else ""
            row.append(f"{ratio:.2f}{spread}")
            for o in runs[k]:
                if o["losses"] != runs["plain"][0]["losses"]:
                    same = False
                if o["reports"]:
                    notes.append(f"{config} / {k}: {o['reports']} reported writes; stderr:\n{o['stderr'][-1500:]}")
        saved = runs["plain"][0]["saved"]
        if saved and "autograd" in guarded:
            extra = [statistics.median(o["times"]) - p for o, p in zip(runs["autograd"], plain)]
            row.append(f"{statistics.median(extra) / saved * 1e6:.1f}")
        else:
            row.append("—")
        row.append("yes" if same and all(o["losses"] == runs["plain"][0]["losses"] for o in runs["plain"]) else "NO")
        print("| " + " | ".join(row) + " |")
    if any(figures.values()):
        row = ["**median over configurations**", "", "", ""] + [
            f"**{statistics.median(v):.2f}**" if v else "—" for v in figures.values()] + ["", ""]
        print("| " + " | ".join(row) + " |")
        row = ["**worst**", "", "", ""] + [f"**{max(v):.2f}**" if v else "—" for v in figures.values()] + ["", ""]
        print("| " + " | ".join(row) + " |")
    print(f"\nload average (1/5/15 min) before and after each round: {' → '.join(loads)}")
    for note in notes:
        print(note)


def profile(config: str, targets: str, steps: int, top: int) -> None:
    import pstats
    import tempfile

    CONTENDERS["profiled"] = ("raise", targets, {})
    path = os.path.join(tempfile.mkdtemp(), "profile.out")
    out = spawn(config, "profiled", steps, profile_out=path)
    if out is None:
        raise SystemExit(f"{config}: its library is not installed")
    stats = pstats.Stats(path)
    rows = []
    total_kvguard = 0.0
    for (filename, line, name), (cc, nc, tt, ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if f"{os.sep}kvguard{os.sep}" in filename:
            total_kvguard += tt
            short = filename.split(f"{os.sep}kvguard{os.sep}", 1)[1]
            rows.append((tt, ct, nc, f"kvguard/{short}:{line}({name})"))
    total = stats.total_tt  # type: ignore[attr-defined]
    print(f"{DESCRIPTIONS.get(config, config)}, KVGUARD=raise KVGUARD_TARGETS={targets}, {steps} steps profiled "
          f"after {WARMUP} warm-up: {total:.3f} s in the profile, {total_kvguard:.3f} s "
          f"({100 * total_kvguard / max(total, 1e-9):.1f} %) of it in kvguard's own Python functions\n")
    print(f"{'own s':>8} {'with callees s':>14} {'calls':>8}  function (top {top} of kvguard's, by own time)")
    for tt, ct, nc, name in sorted(rows, reverse=True)[:top]:
        print(f"{tt:8.4f} {ct:14.4f} {nc:8d}  {name}")
    print(f"\n{'with callees s':>14} {'calls':>8}  function (top {top} of kvguard's, by time with callees)")
    for tt, ct, nc, name in sorted(rows, key=lambda r: r[1], reverse=True)[:top]:
        print(f"{ct:14.4f} {nc:8d}  {name}")


ROLLOUT_ROWS = [  # name, estimator, samples, seq, per_prompt, inner (repetitions per timed run)
    ("grpo-small", "grpo", 8, 64, 4, 20),
    ("grpo-real", "grpo", 64, 2048, 8, 1),
    ("grpo-wide", "grpo", 512, 2048, 8, 1),
    ("rpp-wide", "reinforce_pp", 512, 2048, 8, 1),
]
ROLLOUT_CONTENDERS = ["unguarded", "idle", "kv_compiled", "kv_full_nofp"]


def rollout(rounds: int, repeats: int, only: str | None) -> None:
    """The GRPO-shaped guarded calls: `bench_suite.py`'s advantage pipeline (slime's
    `compute_advantages_and_returns(rollout_data)`) over per-sample lists, under
    `kvguard.guard(rollout_data, action="raise")` with fingerprints on and off, by
    `bench_suite.py`'s own method (its hook installs, rotation, collector handling)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_suite as suite
    import torch

    torch.set_num_threads(1)
    suite.CONTENDER_KEYS[:] = ROLLOUT_CONTENDERS  # the module's globals: read by its rotation and summary

    def order(i: int) -> list[str]:  # its rotation, for two hook groups (none; compiled)
        groups = [[c for c in ROLLOUT_CONTENDERS if suite.HOOK_OF.get(c) == hook] for hook in (None, "compiled")]
        groups = groups[i % 2:] + groups[:i % 2]
        return [c for g in groups for c in g[i % len(g):] + g[:i % len(g)]]

    suite._round_order = order
    loads = []
    for name, est, samples, seq, per_prompt, inner in ROLLOUT_ROWS:
        if only and name not in only.split(","):
            continue
        loads.append(suite.Workload(
            name, "ratio", f"{'GRPO' if est == 'grpo' else 'REINFORCE++'}, {samples} × {seq}",
            build=lambda samples=samples, seq=seq: {"rollout_data": suite.make_rollout(samples, seq),
                                                    "protected": None},
            run=lambda st, est=est, per_prompt=per_prompt: suite.compute_advantages_and_returns(
                st["rollout_data"], est, per_prompt),
            reset=suite._unplace, inner=inner, tensors=6 * samples + 1))
    raw = suite.run_suite(loads, rounds, repeats, progress=lambda line: print(line, file=sys.stderr))
    summary = suite.summarise(loads, raw)
    names = {key: head for key, head, _ in suite.CONTENDERS}
    print(f"\n{rounds} rounds × {repeats} repeats, CPU time, median of per-round ratios (repeat 1 / repeat 2)\n")
    head = ["row", "what", "protected", "unguarded ms"] + [names[k] for k in ROLLOUT_CONTENDERS[1:]]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for w in loads:
        row = summary[w.name]
        base = row["seconds"].get("unguarded", [])
        cells = [w.name, w.what, f"{w.tensors:,}", " / ".join(f"{t * 1e3:.2f}" for t in base)]
        for k in ROLLOUT_CONTENDERS[1:]:
            cells.append(" / ".join(f"{r:.2f}" for r in row["ratio"].get(k, [])))
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--contenders", default=",".join(k for k in CONTENDERS if k != "plain-again"), help="comma-separated; plain is always run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per process")
    parser.add_argument("--quick", action="store_true", help="gpt2 and llama, 1 round")
    parser.add_argument("--profile", metavar="CONFIG", help="profile one configuration with the guard on")
    parser.add_argument("--targets", default="autograd,weights", help="with --profile: KVGUARD_TARGETS")
    parser.add_argument("--top", type=int, default=15, help="with --profile: how many functions")
    parser.add_argument("--vision-path", metavar="DIR", help="where timm and torchvision are installed, if not in "
                        "this environment: on the path of the timm configurations' processes only (transformers "
                        "imports torchvision whenever it can, which costs every other process 2 s)")
    parser.add_argument("--rollout", action="store_true", help="the GRPO-shaped guarded calls instead "
                        f"({', '.join(r[0] for r in ROLLOUT_ROWS)}; --rounds, --repeats, --only)")
    parser.add_argument("--repeats", type=int, default=2, help="with --rollout")
    parser.add_argument("--only", help="with --rollout: comma-separated rows")
    parser.add_argument("--exec", action="store_true", help="start a new interpreter for every run instead of forking "
                        "one from a process per contender (10+ CPU-seconds of imports each: 5-10x longer)")
    parser.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--count-saved", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.zygote:
        zygote(args.configs.split(","))
        return
    if args.child:
        child(args.child, args.steps, args.count_saved, args.profile_out)
        return
    if args.rollout:
        rollout(args.rounds, args.repeats, args.only)
        return
    if args.vision_path:
        VISION_PATH.append(os.path.abspath(args.vision_path))
    if args.profile:
        profile(args.profile, args.targets, args.steps, args.top)
        return
    configs = QUICK if args.quick else [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {CONFIGS}")
    contenders = ["plain"] + [k for k in args.contenders.split(",") if k and k != "plain"]
    if [k for k in contenders if k not in CONTENDERS]:
        parser.error(f"unknown contenders; known: {list(CONTENDERS)}")
    measure(configs, contenders, 1 if args.quick else args.rounds, args.steps, fork=not args.exec)


if __name__ == "__main__":
    main()
