"""verl/workers/rollout/vllm_rollout/utils.py (b178a3cd56f5): the vLLM worker extension's weight update
from the trainer's CUDA IPC buffer, with its signatures. The socket (zmq REP in verl) and the IPC handle
are the caller's: `_socket` answers `recv_pyobj()` with the handle, then each bucket's metadata,
written by the trainer into the shared buffer before it answers."""

from typing import Callable

import torch


def rebuild_ipc(handle: "tuple[Callable, tuple]", device_id: "int | None" = None) -> torch.Tensor:
    func, args = handle
    list_args = list(args)
    return func(*list_args)


class vLLMColocateWorkerExtension:
    def __init__(self, model_runner, socket) -> None:
        self.model_runner = model_runner
        self._socket = socket

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False):
        """Update the weights of the rollout model."""
        socket = self._socket
        handle = socket.recv_pyobj()
        buffer: torch.Tensor = rebuild_ipc(handle)
        assert buffer.dtype == torch.uint8
        socket.send(b"")
        while True:
            metadata = socket.recv_pyobj()
            weights = []
            for name, meta in metadata["bucket_meta"].items():
                shape, dtype, offset = meta["shape"], meta["dtype"], meta["offset"]
                size = dtype.itemsize * shape.numel()
                # NOTE: we need to clone the tensor to release CUDA IPC memory
                tensor = buffer[offset: offset + size].view(dtype=dtype).view(shape).clone()
                weights.append((name, tensor))
            socket.send(b"")
            self._update_weights(weights, peft_config=peft_config, base_sync_done=base_sync_done)
            del weights
            if metadata["is_last"]:
                break
        del buffer

    def _update_weights(self, weights: "list[tuple[str, torch.Tensor]]", peft_config: dict, base_sync_done: bool):
        self.model_runner.model.load_weights(weights)
