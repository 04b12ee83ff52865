"""Where rollout engines and RL frameworks load weights into a model, as data. Stdlib only at import.

`KVGUARD_TARGETS=weights` treats a call of each of these functions as one *load* of the
weights (`kvguard._protect.weights_loads`), as it treats `Module.load_weights(weights)`
(vLLM's and sglang's models) and `Module.load_state_dict`: the writes it makes to the
weights are its own, an element it writes twice is reported, and what it is handed is
protected until it returns. Each function is named as `module:qualname`, then, in
parentheses, the argument holding the module it loads (`(model)`); with no parentheses
it names none, and a write it makes to any watched module's weights is its own (the
models it loads into are watched when their own `load_weights` runs inside it).

Nothing of the frameworks' code is copied here, only where the functions are. Read at:

vLLM 0.34.0 (the wheel on PyPI, vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl):
    vllm/model_executor/model_loader/reload/lifecycle.py  start_reload(model), finish_reload(model, ...):
        a weight update's two ends; with layerwise reloading (the default) `finish_reload` loads
        what each layer buffered, runs `process_weights_after_loading` and copies the result into
        the tensors the CUDA graphs hold (`layerwise._copy_and_restore_kernel_tensors`)
    vllm/model_executor/model_loader/reload/inplace.py  reload_weights(vllm_config, model, ...): one
        reload, start_reload + model.load_weights + finish_reload (or, for kernel-format weights, a
        copy into each parameter then finalize_model_weights)
    vllm/model_executor/model_loader/reload/layerwise.py  initialize_layerwise_reload(model),
        finalize_layerwise_reload(model, ...): the same, called directly by the weight-transfer engines
    vllm/v1/worker/gpu_worker.py  Worker.update_weights(self, update_info),
        Worker.reload_weights(self, weights_iterator, ...): one chunk from the trainer, a reload
sglang 0.5.23 (the wheel on PyPI, sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl):
    sglang/srt/model_executor/model_runner_components/weight_updater.py
        WeightUpdater.update_weights_from_tensor / load_weights_from_distributed /
        update_weights_from_disk / update_weights_from_ipc / begin_weight_update /
        end_weight_update (self, ...), and _model_load_weights_direct(model, named_tensors)
        (`load_format="direct"`: default_weight_loader per parameter, no load_weights)
verl (https://github.com/volcengine/verl, commit b178a3cd56f58b2d502255daba591e92833930a7, 2026-01-29):
    verl/workers/rollout/vllm_rollout/utils.py  vLLMColocateWorkerExtension.update_weights_from_ipc(self, ...):
        rebuilds the trainer's CUDA IPC buffer, clones each bucket's tensors out of it and loads
        them with `model_runner.model.load_weights`
OpenRLHF (https://github.com/OpenRLHF/OpenRLHF, commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7, v0.11.0):
    openrlhf/trainer/ray/vllm_worker_wrap.py  WorkerWrap.update_weight(self, name, dtype, shape, ...),
        WorkerWrap.update_weight_cuda_ipc(self, ...): one weight, broadcast or rebuilt from an IPC
        handle, loaded with `model_runner.model.load_weights(weights=[(name, weight)])`
slime (https://github.com/THUDM/slime, commit 624b824a898ab0ec1fcb4d373004c7f3852bf515, 2026-08-21):
    its rollout engines are sglang servers (slime/backends/sglang_utils/sglang_engine.py posts the
    update over HTTP: `update_weights_from_tensor`, `update_weights_from_distributed`), so its loads
    are sglang's rows above, in the sglang process.

A function missing from the installed version is passed over in silence: the framework's
models' own `load_weights` still makes each load one.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

_FUNCTION = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)(?:\(([A-Za-z_]\w*)\))?$")


@dataclasses.dataclass(frozen=True)
class LoadPoint:
    """One function that loads weights: a call of it is one load."""

    function: str  # `module:qualname(argument holding the module)`, or `module:qualname`
    framework: str  # how the docs name it: `vLLM 0.34.0`
    file: str  # its file in the framework's source, where it was read
    why: str  # what it does to the weights

    @property
    def module(self) -> str:
        return _parts(self.function)[0]

    @property
    def qualname(self) -> str:
        return _parts(self.function)[1]

    @property
    def argument(self) -> Optional[str]:
        """The argument holding the module it loads; None: it names none."""
        return _parts(self.function)[2]


def _parts(function: str) -> tuple[str, str, Optional[str]]:
    match = _FUNCTION.match(function)
    if match is None:
        raise ValueError(f"not a load point: {function!r}")
    return match.group(1), match.group(2), match.group(3)


_VLLM = "vLLM 0.34.0"
_SGLANG = "sglang 0.5.23"
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
_UPDATER_FILE = "sglang/srt/model_executor/model_runner_components/weight_updater.py"

LOAD_POINTS: tuple[LoadPoint, ...] = (
    LoadPoint("vllm.model_executor.model_loader.reload.inplace:reload_weights(model)", _VLLM,
              "vllm/model_executor/model_loader/reload/inplace.py",
              "reloads the model in place: start_reload, model.load_weights, finish_reload; or, for kernel-format "
              "weights, a copy into each parameter then every module's post-load hook"),
    LoadPoint("vllm.model_executor.model_loader.reload.lifecycle:start_reload(model)", _VLLM,
              "vllm/model_executor/model_loader/reload/lifecycle.py",
              "begins a weight update: layerwise, each layer's weights are put on the meta device and its "
              "weight loaders buffer what they are given"),
    LoadPoint("vllm.model_executor.model_loader.reload.lifecycle:finish_reload(model)", _VLLM,
              "vllm/model_executor/model_loader/reload/lifecycle.py",
              "completes it: loads what each layer buffered, runs process_weights_after_loading and copies "
              "the result into the tensors the CUDA graphs hold"),
    LoadPoint("vllm.model_executor.model_loader.reload.layerwise:initialize_layerwise_reload(model)", _VLLM,
              "vllm/model_executor/model_loader/reload/layerwise.py", "the same beginning, called directly"),
    LoadPoint("vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_reload(model)", _VLLM,
              "vllm/model_executor/model_loader/reload/layerwise.py", "the same completion, called directly"),
    LoadPoint("vllm.v1.worker.gpu_worker:Worker.update_weights", _VLLM, "vllm/v1/worker/gpu_worker.py",
              "receives one chunk from the trainer through the weight-transfer engine and loads it"),
    LoadPoint("vllm.v1.worker.gpu_worker:Worker.reload_weights", _VLLM, "vllm/v1/worker/gpu_worker.py",
              "reloads the model from an iterator of (name, tensor) or a path"),
    LoadPoint(f"{_UPDATER}:WeightUpdater.update_weights_from_tensor", _SGLANG, _UPDATER_FILE,
              "loads (name, tensor) pairs rebuilt from IPC handles, or a flattened bucket's views"),
    LoadPoint(f"{_UPDATER}:WeightUpdater.load_weights_from_distributed", _SGLANG, _UPDATER_FILE,
              "loads the tensors receive_weights_from_distributed broadcast into"),
    LoadPoint(f"{_UPDATER}:WeightUpdater.update_weights_from_disk", _SGLANG, _UPDATER_FILE,
              "reloads the weights from a checkpoint"),
    LoadPoint(f"{_UPDATER}:WeightUpdater.update_weights_from_ipc", _SGLANG, _UPDATER_FILE,
              "loads through the checkpoint-engine worker from IPC handles"),
    LoadPoint(f"{_UPDATER}:WeightUpdater.begin_weight_update", _SGLANG, _UPDATER_FILE,
              "undoes the quantization packing so that fresh weights can be loaded"),
    LoadPoint(f"{_UPDATER}:WeightUpdater.end_weight_update", _SGLANG, _UPDATER_FILE,
              "the post-load fix-ups and the quantization packing again"),
    LoadPoint(f"{_UPDATER}:_model_load_weights_direct(model)", _SGLANG, _UPDATER_FILE,
              "load_format='direct': default_weight_loader into each named parameter, no load_weights"),
    LoadPoint("verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension.update_weights_from_ipc",
              "verl b178a3cd56f5", "verl/workers/rollout/vllm_rollout/utils.py",
              "rebuilds the trainer's CUDA IPC buffer, clones each bucket out of it and loads it"),
    LoadPoint("openrlhf.trainer.ray.vllm_worker_wrap:WorkerWrap.update_weight", "OpenRLHF v0.11.0 (3c3be6234e0c)",
              "openrlhf/trainer/ray/vllm_worker_wrap.py", "receives one weight by broadcast and loads it"),
    LoadPoint("openrlhf.trainer.ray.vllm_worker_wrap:WorkerWrap.update_weight_cuda_ipc",
              "OpenRLHF v0.11.0 (3c3be6234e0c)", "openrlhf/trainer/ray/vllm_worker_wrap.py",
              "rebuilds one weight from a CUDA IPC handle and loads it"),
)


def by_module() -> dict[str, list[LoadPoint]]:
    """The load points by the module that defines them (what a post-import hook waits for)."""
    found: dict[str, list[LoadPoint]] = {}
    for point in LOAD_POINTS:
        found.setdefault(point.module, []).append(point)
    return found
