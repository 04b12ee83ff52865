"""sglang/srt/model_executor/model_runner_components/weight_updater.py: the weight-update entry points
of a model runner, with their signatures; the group and device handling reduced to CPU and gloo."""

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed

from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket


@dataclasses.dataclass
class WeightUpdater:
    device: str
    get_model: Callable[[], Any]
    _model_update_group: dict = dataclasses.field(default_factory=dict)

    def receive_weights_from_distributed(self, *, names, dtypes, shapes, group_name, load_format: Optional[str] = None):
        """Receive one broadcast without loading it."""
        if load_format == "flattened_bucket":
            return self._receive_bucketed_weights_from_distributed(names=names, dtypes=dtypes, shapes=shapes,
                                                                   group_name=group_name)
        weights, handles = [], []
        for name, dtype, shape in zip(names, dtypes, shapes):
            weight = torch.empty(shape, dtype=dtype, device=self.device)
            handles.append(torch.distributed.broadcast(weight, src=0, group=self._model_update_group[group_name],
                                                       async_op=True))
            weights.append((name, weight))
        for handle in handles:
            handle.wait()
        return weights

    def _receive_bucketed_weights_from_distributed(self, *, names, dtypes, shapes, group_name):
        metas, offset, parts = [], 0, []
        for name, dtype, shape in zip(names, dtypes, shapes):
            parts.append((name, torch.empty(shape, dtype=dtype)))
        bucket = FlattenedTensorBucket(named_tensors=parts)
        flattened_tensor = bucket.get_flattened_tensor()
        torch.distributed.broadcast(flattened_tensor, src=0, group=self._model_update_group[group_name])
        return bucket.reconstruct_tensors()

    def load_weights_from_distributed(self, named_tensors: List[Tuple[str, torch.Tensor]]) -> Tuple[bool, str]:
        self.get_model().load_weights(named_tensors)
        return True, "Succeeded to update parameter online."

    def update_weights_from_tensor(self, named_tensors: List[Tuple[str, Any]], load_format: Optional[str] = None):
        if load_format == "flattened_bucket":
            return self._update_weights_from_flattened_bucket(flattened_tensor_bucket_dict=named_tensors)
        if load_format == "direct":
            _model_load_weights_direct(self.get_model(), named_tensors)
        elif load_format is None:
            self.get_model().load_weights(named_tensors)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        return True, "Success"

    def _update_weights_from_flattened_bucket(self, flattened_tensor_bucket_dict):
        bucket = FlattenedTensorBucket(flattened_tensor=flattened_tensor_bucket_dict["flattened_tensor"],
                                       metadata=flattened_tensor_bucket_dict["metadata"])
        self.get_model().load_weights(bucket.reconstruct_tensors())
        return True, "Success"


def _model_load_weights_direct(model, named_tensors: List[Tuple[str, torch.Tensor]]):
    params_dict = dict(model.named_parameters())
    for name, tensor in named_tensors:
        default_weight_loader(params_dict[name], tensor)
