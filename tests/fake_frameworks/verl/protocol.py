"""Replica of verl/protocol.py: `DataProto`, a dataclass around a TensorDict and numpy arrays."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tensordict import TensorDict


@dataclass
class DataProto:
    batch: TensorDict = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.batch.batch_size[0]) if self.batch is not None else 0

    @classmethod
    def from_dict(cls, tensors: dict, non_tensors: dict | None = None, meta_info: dict | None = None) -> "DataProto":
        size = next(iter(tensors.values())).shape[0]
        arrays = {k: np.asarray(v, dtype=object) for k, v in (non_tensors or {}).items()}
        return cls(TensorDict(tensors, batch_size=[size]), arrays, dict(meta_info or {}))
