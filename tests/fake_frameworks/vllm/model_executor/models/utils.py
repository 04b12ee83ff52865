"""vllm/model_executor/models/utils.py: `AutoWeightsLoader`, which walks a model's children once over
the weights iterator, grouped by the first part of each name (as vLLM's: a child module's own
`load_weights` if it has one, else each parameter's `weight_loader`, else `default_weight_loader`)."""

import itertools
from collections.abc import Iterable

import torch
from torch import nn

from vllm.model_executor.model_loader.weight_utils import default_weight_loader


class AutoWeightsLoader:
    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def _groupby_prefix(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterable[tuple[str, Iterable[tuple[str, torch.Tensor]]]]:
        weights_by_parts = ((weight_name.split(".", 1), weight_data) for weight_name, weight_data in weights)
        for prefix, group in itertools.groupby(weights_by_parts, key=lambda x: x[0][0]):
            yield prefix, (("" if len(parts) == 1 else parts[1], weights_data) for parts, weights_data in group)

    def _load_param(self, base_prefix: str, param: nn.Parameter,
                    weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str]:
        for weight_name, weight_data in weights:
            if weight_name != "":
                raise ValueError(f"Attempted to load nested weight {weight_name!r} into a single parameter "
                                 f"{base_prefix!r}")
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, weight_data)
            yield base_prefix

    def _load_module(self, base_prefix: str, module: nn.Module,
                     weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str]:
        if module is not self.module:
            module_load_weights = getattr(module, "load_weights", None)
            if callable(module_load_weights):
                yield from (f"{base_prefix}.{name}" for name in module_load_weights(weights))
                return
        child_modules = dict(module.named_children())
        child_params = dict(module.named_parameters(recurse=False))
        for child_prefix, child_weights in self._groupby_prefix(weights):
            prefix = f"{base_prefix}.{child_prefix}" if base_prefix else child_prefix
            if child_prefix in child_modules:
                yield from self._load_module(prefix, child_modules[child_prefix], child_weights)
            elif child_prefix in child_params:
                yield from self._load_param(prefix, child_params[child_prefix], child_weights)
            else:
                raise ValueError(f"There is no module or parameter named {prefix!r}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, mapper: object = None) -> set[str]:
        return set(self._load_module("", self.module, weights))
