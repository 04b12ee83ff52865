"""vllm/model_executor/model_loader/reload/inplace.py: one in-place reload of a model's weights."""

from collections.abc import Iterable

import torch

from vllm.model_executor.model_loader.weight_utils import finalize_model_weights

from .lifecycle import finish_reload, start_reload


def reload_weights(vllm_config: object, model: torch.nn.Module,
                   weights_iterator: "Iterable[tuple[str, torch.Tensor]] | None", weights_path: "str | None",
                   is_checkpoint_format: bool) -> None:
    if is_checkpoint_format:
        start_reload(model)
        model.load_weights(weights_iterator)
        finish_reload(model, None, torch.device("cpu"))
    else:  # kernel-format weights: copied in place, then every module's own post-load hook
        params = dict(model.named_parameters())
        with torch.no_grad():  # vLLM's workers run without autograd
            for name, loaded_weight in weights_iterator:
                params[name].copy_(loaded_weight)
        finalize_model_weights(model)
