"""sglang/srt/weight_sync/tensor_bucket.py: many tensors sent as one flat tensor, rebuilt as views of it."""

import dataclasses

import torch


@dataclasses.dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None) -> None:
        if named_tensors is not None:
            self.metadata, offset, parts = [], 0, []
            for name, tensor in named_tensors:
                flat = tensor.flatten().view(torch.uint8)
                self.metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset,
                                                             offset + flat.numel(), tensor.numel()))
                parts.append(flat)
                offset += flat.numel()
            self.flattened_tensor = torch.cat(parts)
        else:
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def reconstruct_tensors(self) -> list:
        return [(meta.name, self.flattened_tensor[meta.start_idx: meta.end_idx].view(meta.dtype).reshape(meta.shape))
                for meta in self.metadata]
