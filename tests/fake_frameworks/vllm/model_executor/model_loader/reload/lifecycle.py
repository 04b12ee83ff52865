"""vllm/model_executor/model_loader/reload/lifecycle.py: a weight update's two ends."""

import torch

from .layerwise import finalize_layerwise_reload, initialize_layerwise_reload

_weight_update_active = False


def weight_update_active() -> bool:
    return _weight_update_active


def start_reload(model: torch.nn.Module) -> None:
    global _weight_update_active
    initialize_layerwise_reload(model)
    _weight_update_active = True


def finish_reload(model: torch.nn.Module, model_config: object, device: torch.device) -> None:
    global _weight_update_active
    _weight_update_active = False
    finalize_layerwise_reload(model, model_config)
