"""Real libraries under `KVGUARD=raise KVGUARD_TARGETS=autograd,weights`, each job in a fresh process (slow).

timm (a ResNet with batch norm, trained with SGD, with timm's own ModelEmaV2 and
ModelEmaV3), peft (LoRA on a tiny transformers Llama built from a config, then
`merge_and_unload()` with and without `safe_merge`; PiSSA initialisation after a load),
transformers (`resize_token_embeddings()` after a load: BERT with a new head, GPT-2 with
its tied LM head and its optimizer made before the load) and trl (`SyncRefModelCallback`'s
reference sync, called as its callback calls it): each runs a few steps with the switches
on and off; the run with them is clean, the libraries' writes counted as intended, and
its losses, gradients and weights are bitwise those of the run without. Then a bug
injected into each is stopped at its line. The jobs also check that the intended writers'
table (`kvguard/_intended.py`) names functions the installed libraries have, with the
arguments it names (tests/intended_table.py). No weights are downloaded; each test skips
where its library is not installed.

The library-line tier: with `REAL_LIBRARIES_PYTHON=/path/to/venv/bin/python` the jobs run
in that Python, so the same tests prove another line of transformers, peft and trl (those
RL frameworks pin); docs/weights.md#library-versions has the command, the lines and their
outcomes. Without it the jobs run in this Python: CI's slow tier, with transformers
5.25.0, peft 0.21.2, trl 1.16.0, timm 1.0.31 and torch 2.13.0.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

ENV = {"KVGUARD": "raise", "KVGUARD_TARGETS": "autograd,weights", "HF_HUB_OFFLINE": "1"}
# The Python the jobs run in: a library line's (the manual tier), or this one
PYTHON = os.environ.get("REAL_LIBRARIES_PYTHON") or sys.executable
TESTS = str(Path(__file__).resolve().parent)

# Appended to a job: the functions of the intended writers of `DISTS` that the installed libraries
# lack (tests/intended_table.py), saved with the job's results.
TABLE_CHECK = '''
import sys as _sys
_sys.path.insert(0, TESTS)
import intended_table
from kvguard import _intended
unmatched = sorted(f for w in _intended.WRITERS if w.distribution in DISTS and w.how == "scope"
                   for f in intended_table.unmatched(w))
'''

# timm imports torchvision. A torchvision built for another torch (the only one some package
# indexes serve next to a CPU torch) cannot load its kernels, and its import then fails on
# `register_fake("torchvision::nms")`: the two schemas, defined first, let it import (its
# kernels are not used here). Where torchvision works this is never reached.
IMPORT_TIMM = '''
import sys
import torch
try:
    import torchvision  # noqa: F401
except Exception:
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    _lib = torch.library.Library("torchvision", "DEF")
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import timm
from timm.utils import ModelEmaV2, ModelEmaV3
'''

TIMM_JOB = IMPORT_TIMM + '''
torch.manual_seed(0)
model = timm.create_model("resnet18", pretrained=False, num_classes=10)
model.train()
ema2, ema3 = ModelEmaV2(model, decay=0.9), ModelEmaV3(model, decay=0.9)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
if BUG:
    def halve(module, args, out):
        module.weight.data.mul_(0.5)  # the bug: a forward hook rescales the weight
    model.bn1.register_forward_hook(halve)
data = torch.Generator().manual_seed(1)
losses, grads = [], []
for step in range(3):
    x, y = torch.randn(4, 3, 32, 32, generator=data), torch.randint(0, 10, (4,), generator=data)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    losses.append(loss.detach())
    grads.append([p.grad.clone() for p in model.parameters()])
    opt.step()
    opt.zero_grad()
    ema2.update(model)
    ema3.update(model, step=step)
torch.save({"losses": losses, "grads": grads, "weights": [t.clone() for t in model.state_dict().values()],
            "ema": [t.clone() for m in (ema2.module, ema3.module) for t in m.state_dict().values()]}, OUT)
'''

# A tiny Llama built from a config, then its trainable parameters trained 3 steps (`model` set in between).
_TINY_LLAMA = '''
import torch
import transformers
import peft
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, use_cache=False)
'''
_TRAIN_TRAINABLE = '''
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
losses, grads = [], []
for _ in range(3):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    losses.append(loss.detach())
    grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    opt.step()
    opt.zero_grad()
'''

PEFT_JOB = _TINY_LLAMA + '''
model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                            peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
''' + _TRAIN_TRAINABLE + '''
if BUG:
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    layer.lora_B["default"].weight.data.zero_()  # the bug: resets a trained adapter between steps
merged = model.merge_and_unload()  # safe_merge=True: the PiSSA job's
''' + TABLE_CHECK + '''
torch.save({"losses": losses, "grads": grads, "weights": [t.clone() for t in merged.state_dict().values()],
            "unmatched": unmatched}, OUT)
'''

PISSA_JOB = _TINY_LLAMA + '''
model = transformers.LlamaForCausalLM(config)
model.load_state_dict(model.state_dict())  # a checkpoint loaded by hand: the weights are watched from here on
model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=INIT))
''' + _TRAIN_TRAINABLE + '''
merged = model.merge_and_unload(safe_merge=True)  # the other merge of PEFT_JOB's: `.data =` a merged copy
torch.save({"losses": losses, "grads": grads, "weights": [t.clone() for t in merged.state_dict().values()]}, OUT)
'''

HEAD_JOB = '''
import torch
import transformers
torch.manual_seed(0)
config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, num_labels=3)
model = transformers.BertForSequenceClassification(config)
model.load_state_dict(model.state_dict())  # a checkpoint loaded by hand: the weights are watched from here on
model.resize_token_embeddings(136)  # a pad token and chat tokens added
model._init_weights(model.classifier)  # a new head for this task
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 136, (2, 8), generator=torch.Generator().manual_seed(1))
losses, grads = [], []
for _ in range(2):
    loss = model(input_ids=ids, labels=torch.tensor([0, 2])).loss
    loss.backward()
    losses.append(loss.detach())
    grads.append([p.grad.clone() for p in model.parameters()])
    opt.step()
    opt.zero_grad()
# GPT-2, its LM head tied to the embedding, its optimizer made before the load (issue 36's repro): the
# resize re-points the embedding the optimizer holds to its grown copy
config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64)
lm = transformers.GPT2LMHeadModel(config)
lm_opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
lm.load_state_dict(lm.state_dict())
lm.resize_token_embeddings(104)
assert lm.lm_head.weight is lm.transformer.wte.weight and lm.lm_head.weight.shape[0] == 104
ids = torch.randint(0, 104, (2, 8), generator=torch.Generator().manual_seed(2))
for _ in range(2):
    loss = lm(input_ids=ids, labels=ids).loss
    loss.backward()
    losses.append(loss.detach())
    lm_opt.step()
    lm_opt.zero_grad()
''' + TABLE_CHECK + '''
torch.save({"losses": losses, "grads": grads, "unmatched": unmatched,
            "weights": [t.clone() for m in (model, lm) for t in m.state_dict().values()]}, OUT)
'''

TRL_JOB = '''
import torch
from accelerate import Accelerator
from trl.trainer.callbacks import SyncRefModelCallback
Accelerator(cpu=True)
torch.manual_seed(0)
policy = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
ref.load_state_dict(policy.state_dict())  # the reference model: watched from its first load on
opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
losses = []
for _ in range(3):
    loss = (policy(torch.randn(4, 8)) - ref(torch.randn(4, 8)).detach()).pow(2).mean()
    loss.backward()
    losses.append(loss.detach())
    opt.step()
    opt.zero_grad()
    SyncRefModelCallback.sync_target_model(policy, ref, 0.6)  # what on_step_end calls
if BUG:
    with torch.no_grad():
        ref[2].weight.mul_(0.5)  # the bug: a stray write to the reference model
''' + TABLE_CHECK + '''
torch.save({"losses": losses, "weights": [t.clone() for t in ref.state_dict().values()], "unmatched": unmatched}, OUT)
'''


@functools.lru_cache(maxsize=None)
def _installed() -> dict[str, str]:
    """module -> version ('' where it has none) of what the jobs' Python can import, found (not imported)."""
    script = ("import importlib.util, importlib.metadata as m, json, sys\n"
              "def v(d):\n    try: return m.version(d)\n    except Exception: return ''\n"
              "print(json.dumps({n: v(n) for n in sys.argv[1:] if importlib.util.find_spec(n) is not None}))")
    names = ["timm", "torchvision", "transformers", "peft", "trl", "accelerate", "torch"]
    result = subprocess.run([PYTHON, "-c", script, *names], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KVGUARD": ""})
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def _needs(*modules: str) -> None:
    """Skip unless every module can be found (found, not imported: timm's import may need IMPORT_TIMM).

    Under CI, whose `ci` extra installs all but timm and torchvision, a missing one is a failure.
    """
    for module in modules:
        if module not in _installed():
            if os.environ.get("CI") and module not in ("timm", "torchvision"):
                pytest.fail(f"{module} is not installed under CI (the ci extra installs it)")
            pytest.skip(f"{module} is not installed in {PYTHON}")


def _release(dist: str) -> tuple[int, ...]:
    from kvguard._intended import _release as release

    return release(_installed()[dist])


def _absent(dist: str) -> list[str]:
    """The intended writers' functions of `dist` that its installed version has not (read in each line):
    `unmatched` of a job that ran them must be exactly these."""
    version = _release(dist)
    if dist == "transformers":  # PreTrainedModel.initialize_weights from 4.53, transformers.initialization from 5
        return sorted((["transformers.*:*.initialize_weights(self)"] if version < (4, 53) else [])
                      + (["transformers.initialization:*(tensor)"] if version < (5,) else []))
    if dist == "peft":
        since = {"pissa_init": (0, 11), "olora_init": (0, 12), "corda_init": (0, 15), "lora_ga_init": (0, 19)}
        return sorted(f"peft.tuners.lora.layer:*.{init}(self)" for init, first in since.items() if version < first)
    if dist == "trl":  # in trl.trainer.utils up to 0.9, trl.trainer.callbacks from 0.10
        module = "utils" if version >= (0, 10) else "callbacks"
        return [f"trl.trainer.{module}:SyncRefModelCallback._sync_target_model(target_model)"]
    return []


def _run(tmp_path: Path, job: str, name: str, guarded: bool, **values: Any) -> tuple[Any, dict[str, Any]]:
    out = tmp_path / f"{name}.pt"
    script = tmp_path / f"job_{name}.py"
    lines = [f"{key} = {value!r}" for key, value in {**values, "OUT": str(out), "TESTS": TESTS}.items()]
    script.write_text("\n".join(lines) + "\n" + textwrap.dedent(job))
    env = ENV if guarded else {"KVGUARD": "", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([PYTHON, str(script)], env={**os.environ, **env}, cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    return result, (torch.load(out) if out.exists() else {})


def _bitwise(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bitwise(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bitwise(a[k], b[k]) for k in a)
    return bool(a == b)


def _clean_and_bitwise(tmp_path: Path, job: str, name: str, **values: Any) -> tuple[list[str], dict[str, Any]]:
    """Run `job` with the switches off and on: clean, bitwise the same; returns the guarded run's kvguard lines
    and what it saved."""
    plain, expected = _run(tmp_path, job, f"{name}_plain", False, BUG=False, **values)
    assert plain.returncode == 0, plain.stderr
    result, got = _run(tmp_path, job, name, True, BUG=False, **values)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith(("kvguard", "  "))]
    assert "MutationError" not in result.stderr and not any("write at" in line or "writes at" in line
                                                            for line in lines), result.stderr
    assert expected and _bitwise(expected, got)
    return lines, got


def _caught(tmp_path: Path, job: str, name: str, marker: str, **values: Any) -> str:
    """Run `job` with its bug under the switches: stopped at the bug's line; returns stderr."""
    result, _ = _run(tmp_path, job, f"{name}_bug", True, BUG=True, **values)
    script = tmp_path / f"job_{name}_bug.py"
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if marker in text)
    assert result.returncode == 1, result.stderr
    assert f'File "{script}", line {line}' in result.stderr and "kvguard.MutationError" in result.stderr
    return result.stderr


def test_timm_resnet_with_batch_norm_and_ema_is_clean_bitwise_and_a_stray_write_is_caught(tmp_path: Path) -> None:
    _needs("timm", "torchvision")
    lines, _ = _clean_and_bitwise(tmp_path, TIMM_JOB, "timm")
    assert any(line.startswith("kvguard: autograd: ") and line.endswith("no in-place writes") for line in lines)
    assert "kvguard: weights: 122 parameters and buffers watched over 3 optimizer steps, no in-place writes" in lines
    stderr = _caught(tmp_path, TIMM_JOB, "timm", "module.weight.data.mul_(0.5)")
    assert "kvguard.MutationError: model.bn1.weight would be modified in place by aten.mul_.Tensor" in stderr


def test_peft_lora_training_then_merge_is_clean_bitwise_and_its_merge_intended(tmp_path: Path) -> None:
    _needs("peft", "transformers")
    lines, got = _clean_and_bitwise(tmp_path, PEFT_JOB, "peft", DISTS=("peft", "transformers"))
    # 2 layers x (q_proj, v_proj): `+=` on `.data` is one add_ (its `.data =` lays out the same
    # elements again: no re-point; peft 0.10 and 0.11 re-point to `weight.data + delta`, once too)
    assert "  allowed: 4 writes by intended writer peft LoRA merge" in lines
    assert any(line.startswith("kvguard: weights: ") and "over 3 optimizer steps, no in-place writes, " in line
               for line in lines)
    assert got["unmatched"] == sorted(_absent("peft") + _absent("transformers")), _installed()


def test_peft_a_stray_write_to_an_adapter_is_caught_at_its_line(tmp_path: Path) -> None:
    _needs("peft", "transformers")
    stderr = _caught(tmp_path, PEFT_JOB, "peft", 'weight.data.zero_()', DISTS=())
    assert ("lora_B.default.weight would be modified in place by aten.zero_.default" in stderr)


def test_peft_pissa_init_after_a_load_then_a_safe_merge_are_intended_clean_and_bitwise(tmp_path: Path) -> None:
    _needs("peft", "transformers")
    if _release("peft") < (0, 11):
        pytest.skip(f"peft {_installed()['peft']} has no PiSSA (from 0.11)")
    lines, _ = _clean_and_bitwise(tmp_path, PISSA_JOB, "pissa", INIT="pissa")
    # 2 layers x (q_proj, v_proj): `base_layer.weight.data = weight - scaling * B @ A`; then
    # safe_merge's `.data =` to a merged copy, one each
    assert "  allowed: 4 writes by intended writer peft LoRA initialisation from the base weights" in lines
    assert "  allowed: 4 writes by intended writer peft LoRA merge" in lines


def test_transformers_resize_and_a_new_head_after_a_load_are_intended_clean_and_bitwise(tmp_path: Path) -> None:
    _needs("transformers")
    lines, got = _clean_and_bitwise(tmp_path, HEAD_JOB, "head", DISTS=("transformers",))
    # the two resizes re-point each embedding once (GPT-2's LM head is the same Parameter). BERT's new head:
    # transformers 5 initialises it through torch.nn.init (the innermost writer: torch's), 4.x with
    # `module.weight.data.normal_()` and `module.bias.data.zero_()` in its own `_init_weights`
    if _release("transformers") >= (5,):
        assert "  allowed: 2 writes by intended writer transformers weight initialisation and embedding resize" in lines
        assert "  allowed: 2 writes by intended writer torch's initialisers" in lines  # the head's weight and bias
    else:
        assert "  allowed: 4 writes by intended writer transformers weight initialisation and embedding resize" in lines
        assert not any("torch's initialisers" in line for line in lines)
    assert got["unmatched"] == _absent("transformers"), _installed()


def test_trl_reference_sync_is_intended_and_a_stray_write_to_the_reference_is_caught(tmp_path: Path) -> None:
    _needs("trl", "accelerate")
    lines, got = _clean_and_bitwise(tmp_path, TRL_JOB, "trl", DISTS=("trl",))
    assert "  allowed: 24 writes by intended writer trl SyncRefModelCallback" in lines
    assert got["unmatched"] == _absent("trl"), _installed()
    stderr = _caught(tmp_path, TRL_JOB, "trl", "ref[2].weight.mul_(0.5)", DISTS=())
    assert "kvguard.MutationError: ref.2.weight would be modified in place by aten.mul_.Tensor" in stderr
