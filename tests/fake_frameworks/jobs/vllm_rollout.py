"""A vLLM-style rollout worker on the replica (`tests/fake_frameworks/vllm`), no optimizer: each step
the trainer's weights arrive in buckets through one reused receive buffer and are loaded with
`model.load_weights(...)`, then the worker generates. Run it with a shape name:

- clean: 20 steps; a generator copies each bucket into the buffer and yields views of it, which
  vLLM's AutoWeightsLoader consumes one at a time (the loop variable still holds the last view
  when the generator refills the buffer: no use). Prints a digest of every generation.
- stray: a write to the loaded weights between two loads (a logging helper scaling lm_head).
- reload_restore: vLLM's layerwise reload before the fix: `finish_reload` copies the fresh
  weights into the kernel tensors, then copies back a non-persistent buffer that views a
  weight, holding its value from before the reload: the weight is written twice in one load.
- reload_fixed: the same reload with the fix (that buffer is not copied back).
- lazy_refill: one bucket per weight, all at the buffer's start: the generator refills the region the
  view it yielded last lies in while the loader's loop variables still reference it (consumed).
- kernel_format: `reload_weights(..., is_checkpoint_format=False)`: kernel-format weights copied in,
  then every module's post-load hook, one of which rounds lm_head's weight in place (a second
  write in the reload's load, by design: vLLM's post-load transform, an intended writer).
- collect: a model whose load_weights collects its iterator (`dict(weights)`) while the generator
  refills one bucket region: the views handed out earlier are overwritten before they are loaded.
- stash: a model whose load_weights takes the items one at a time with a `for` loop but stashes each
  in a dict to load them all after: the refill overwrites the items it keeps.
- kept_views: a receive function that keeps views of the buffer for a later load (no clone); the
  next bucket's copy overwrites them (the buffer is known as a receive buffer from the first load on).
- all_gather: the same receive through `dist.all_gather_single` into the reused buffer
  (a world of one gloo process): a receive buffer from its first receive.
"""

import hashlib
import os
import sys

import torch
from vllm.model_executor.model_loader.reload import layerwise
from vllm.model_executor.model_loader.reload.inplace import reload_weights
from vllm.model_executor.model_loader.reload.lifecycle import finish_reload, start_reload
from vllm.model_executor.models.llama import LlamaForCausalLM

SHAPE = sys.argv[1]
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
torch.manual_seed(0)
trainer = LlamaForCausalLM()  # the trainer's copy: what is sent each step
rollout_model = LlamaForCausalLM()
names = [name for name, _ in trainer.named_parameters()]
shapes = {name: p.shape for name, p in trainer.named_parameters()}
BUCKET = 4096  # elements a bucket holds: several weights each
buffer = torch.empty(BUCKET)


def buckets():
    """The trainer's weights in buckets of whole tensors: [(name, offset, numel)]; one each, all at
    the buffer's start, for `collect`."""
    if SHAPE in ("collect", "lazy_refill", "stash"):
        return [[(name, 0, p.numel())] for name, p in trainer.named_parameters()]
    out, current, offset = [], [], 0
    for name, p in trainer.named_parameters():
        if offset + p.numel() > BUCKET:
            out.append(current)
            current, offset = [], 0
        current.append((name, offset, p.numel()))
        offset += p.numel()
    return out + [current]


def stream():
    """Each bucket copied into the reused buffer, its weights yielded as views of it."""
    sent = dict(trainer.named_parameters())
    for bucket in buckets():
        for name, offset, n in bucket:
            buffer[offset:offset + n].copy_(sent[name].detach().view(-1))  # receive the bucket
        for name, offset, n in bucket:
            yield name, buffer[offset:offset + n].view(shapes[name])


def train_step(step):
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.01)


def receive_keeping_views():
    """A receive that keeps views of the buffer for the load that follows (verl #6688's shape)."""
    pending = {}
    sent = dict(trainer.named_parameters())
    for bucket in buckets():
        for name, offset, n in bucket:
            buffer[offset:offset + n].copy_(sent[name].detach().view(-1))  # the next bucket lands here
        for name, offset, n in bucket:
            pending[name] = buffer[offset:offset + n].view(shapes[name])
    return pending


def receive_by_all_gather():
    import torch.distributed as dist

    pending = {}
    sent = dict(trainer.named_parameters())
    for bucket in buckets():
        flat = torch.cat([sent[name].detach().view(-1) for name, _, _ in bucket])
        dist.all_gather_single(buffer[:flat.numel()], flat)  # the next bucket lands here
        for name, offset, n in bucket:
            pending[name] = buffer[offset:offset + n].view(shapes[name])
    return pending


class CollectingLlama(LlamaForCausalLM):
    """A model whose load_weights collects every (name, tensor) before loading any."""

    def load_weights(self, weights):
        collected = dict(weights)
        return super().load_weights(collected.items())


class StashingLlama(LlamaForCausalLM):
    """A model whose load_weights stashes every (name, tensor) with a loop, then loads them."""

    def load_weights(self, weights):
        stash = {}
        for name, weight in weights:
            stash[name] = weight
        return super().load_weights(stash.items())


if SHAPE == "stash":
    rollout_model = StashingLlama()
if SHAPE == "all_gather":
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
    dist.init_process_group("gloo", rank=0, world_size=1)
if SHAPE == "collect":
    rollout_model = CollectingLlama()
if SHAPE == "reload_restore":
    layerwise.RESTORE_LOADED_BUFFERS_ONLY = False
if SHAPE.startswith("reload"):
    # a kernel's view of the weight, kept as a non-persistent buffer of the same layer
    rollout_model.lm_head.register_buffer("weight_t", rollout_model.lm_head.weight.data.t(), persistent=False)

if SHAPE == "kernel_format":
    head = rollout_model.lm_head
    head.process_weights_after_loading = lambda: head.weight.copy_(head.weight.to(torch.bfloat16).float())

prompt = torch.tensor([[1, 2, 3, 4]])
digest = hashlib.sha256()
for step in range(STEPS):
    train_step(step)
    if SHAPE == "kept_views":
        rollout_model.load_weights(receive_keeping_views().items())
    elif SHAPE == "all_gather":
        rollout_model.load_weights(receive_by_all_gather().items())
    elif SHAPE == "kernel_format" and step > 0:
        reload_weights(None, rollout_model, stream(), None, False)
    elif SHAPE.startswith("reload") and step > 0:
        start_reload(rollout_model)
        rollout_model.load_weights(stream())
        finish_reload(rollout_model, None, torch.device("cpu"))
    else:
        rollout_model.load_weights(stream())
    out = rollout_model.generate(prompt, 8)
    digest.update(out.numpy().tobytes())
    if SHAPE == "stray" and step == 0:
        with torch.no_grad():
            rollout_model.lm_head.weight.mul_(0.5)  # a logging helper that meant to scale a copy
print("digest", digest.hexdigest(), flush=True)
