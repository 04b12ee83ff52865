"""vllm/model_executor/model_loader/reload/layerwise.py, in miniature.

`initialize_layerwise_reload` keeps each layer's current tensors (the *kernel tensors*, which
CUDA graphs hold) and makes the layer's parameter loaders buffer what they are given;
`finalize_layerwise_reload` materializes each layer on fresh tensors, loads the buffered
weights into them, processes them, and copies the result into the kernel tensors
(`_copy_and_restore_kernel_tensors`), parameters then buffers. Up to the fix, a non-persistent
buffer that no weight loaded was copied back too: one that views a weight (an alias kept for a
kernel) then overwrote the weight just copied in with what the fresh layer held for it, its
value from before the reload. `RESTORE_LOADED_BUFFERS_ONLY = False` is that version.
"""

import dataclasses

import torch

RESTORE_LOADED_BUFFERS_ONLY = True  # the fix: `if name in non_persistent and name not in loaded: continue`


@dataclasses.dataclass
class LayerReloadingInfo:
    kernel_tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    kernel_non_persistent_buffers: set[str] = dataclasses.field(default_factory=set)
    restore_values: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    loaded_weights: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)


_INFO: "dict[int, LayerReloadingInfo]" = {}


def get_layerwise_info(layer: torch.nn.Module) -> LayerReloadingInfo:
    return _INFO.setdefault(id(layer), LayerReloadingInfo())


def initialize_layerwise_reload(model: torch.nn.Module, *, defer_processing: bool = False) -> None:
    for layer in model.modules():
        params = dict(layer.named_parameters(recurse=False))
        buffers = dict(layer.named_buffers(recurse=False))
        if not params and not buffers:
            continue
        info = get_layerwise_info(layer)
        info.kernel_tensors = (params, buffers)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        info.restore_values = {name: b.detach().clone() for name, b in buffers.items()}  # the metadata kept
        info.loaded_weights = []
        for name, param in params.items():
            param.weight_loader = _buffering_loader(info, name)


def _buffering_loader(info: LayerReloadingInfo, name: str):
    def online_process_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        info.loaded_weights.append((name, loaded_weight.clone()))
    return online_process_loader


def finalize_layerwise_reload(model: torch.nn.Module, model_config: object) -> None:
    for layer in model.modules():
        info = _INFO.pop(id(layer), None)
        if info is None:
            continue
        params, buffers = info.kernel_tensors
        for param in params.values():
            del param.weight_loader
        fresh = {name: torch.empty_like(p) for name, p in params.items()}  # materialized
        for name, weight in info.loaded_weights:
            fresh[name].copy_(weight)
        fresh_buffers = {name: info.restore_values[name] for name in buffers}
        _copy_and_restore_kernel_tensors(layer, info, fresh, fresh_buffers)


def _copy_and_restore_kernel_tensors(layer: torch.nn.Module, info: LayerReloadingInfo,
                                     fresh: dict[str, torch.Tensor], fresh_buffers: dict[str, torch.Tensor]) -> None:
    """Copy processed values into original kernel tensor storage (preserves cudagraph refs)."""
    parameters, buffers = info.kernel_tensors
    loaded_tensor_names = {name for name, _ in info.loaded_weights}
    for name, param in parameters.items():
        param.data.copy_(fresh[name])
    for name, buffer in buffers.items():
        if RESTORE_LOADED_BUFFERS_ONLY and name in info.kernel_non_persistent_buffers \
                and name not in loaded_tensor_names:
            continue
        buffer.data.copy_(fresh_buffers[name])
