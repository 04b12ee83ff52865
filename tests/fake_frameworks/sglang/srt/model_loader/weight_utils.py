"""sglang/srt/model_loader/weight_utils.py: the default weight loader."""

import torch


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
    else:
        assert param.size() == loaded_weight.size()
        param.data.copy_(loaded_weight)
