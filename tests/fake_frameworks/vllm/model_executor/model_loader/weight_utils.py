"""vllm/model_executor/model_loader/weight_utils.py: the default weight loader."""

import torch


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy `loaded_weight` into `param` (a one-element weight is reshaped to the parameter's shape)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.copy_(loaded_weight.view(param.shape))
    else:
        assert param.size() == loaded_weight.size(), (
            f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})")
        param.data.copy_(loaded_weight)


def finalize_model_weights(model: torch.nn.Module, target_device: "torch.device | None" = None) -> None:
    """Run every module's own post-load hook after a full load or reload, each after its submodules."""
    for module in reversed(list(model.modules())):
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            with torch.no_grad():
                hook()
