"""verl's vLLM rollout worker on the replicas (`verl.workers.rollout.vllm_rollout.utils`, the vLLM
model), no optimizer: each step the trainer writes its weights bucket by bucket into one shared
buffer (its CUDA IPC buffer; here a buffer the trainer's side fills in this process before it
answers the socket), and the worker clones each bucket out and loads it. Shapes: clean (5 steps,
prints a digest), stray (a write to the loaded weights between two updates)."""

import hashlib
import sys
import types

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from vllm.model_executor.models.llama import LlamaForCausalLM

SHAPE = sys.argv[1]
torch.manual_seed(0)
trainer, rollout = LlamaForCausalLM(), LlamaForCausalLM()
shared = torch.empty(1 << 16, dtype=torch.uint8)  # the trainer's IPC buffer
BUCKET = 8192  # bytes


class TrainerSide:
    """The zmq socket of verl's vLLMRollout.update_weights, as the worker sees it."""

    def __init__(self) -> None:
        self.messages = iter(self._messages())

    def _messages(self):
        yield (lambda: shared, ())  # the IPC handle: `func(*args)` rebuilds the buffer
        meta, offset = {}, 0
        for name, p in trainer.named_parameters():
            raw = p.detach().reshape(-1).view(torch.uint8)
            if offset + raw.numel() > BUCKET:
                yield {"bucket_meta": meta, "is_last": False}
                meta, offset = {}, 0
            shared[offset: offset + raw.numel()].copy_(raw)  # the trainer writes the bucket
            meta[name] = {"name": name, "shape": p.shape, "dtype": p.dtype, "offset": offset}
            offset += raw.numel()
        yield {"bucket_meta": meta, "is_last": True}

    def recv_pyobj(self):
        return next(self.messages)

    def send(self, data: bytes) -> None:
        pass


worker = vLLMColocateWorkerExtension(types.SimpleNamespace(model=rollout), None)
digest = hashlib.sha256()
for step in range(5):
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    worker._socket = TrainerSide()
    worker.update_weights_from_ipc()
    digest.update(rollout.generate(torch.tensor([[3, 1, 4]]), 6).numpy().tobytes())
    if SHAPE == "stray" and step == 2:
        with torch.no_grad():
            rollout.model.norm.weight.fill_(1.0)  # a stray write between two updates
print("digest", digest.hexdigest(), flush=True)
