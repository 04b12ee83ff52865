"""An sglang-style rollout worker on the replica (`tests/fake_frameworks/sglang`), no optimizer: each
step the trainer's weights arrive through `WeightUpdater.update_weights_from_tensor`. Shapes:

- direct: `load_format="direct"` (`_model_load_weights_direct`: the default weight loader into
  each named parameter, no `load_weights`), 5 steps; prints a digest of the outputs.
- flattened: `load_format="flattened_bucket"`: one flat tensor per step, rebuilt as views of it
  (`FlattenedTensorBucket.reconstruct_tensors`) and loaded with `load_weights`, 5 steps.
- stray: `direct`, then a write to the loaded weights between two updates.
"""

import hashlib
import sys

import torch
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

SHAPE = sys.argv[1]
torch.manual_seed(0)
trainer = LlamaForCausalLM()
model = LlamaForCausalLM()
updater = WeightUpdater(device="cpu", get_model=lambda: model)
digest = hashlib.sha256()
for step in range(5):
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    named = [(name, p.detach().clone()) for name, p in trainer.named_parameters()]
    if SHAPE == "flattened":
        bucket = FlattenedTensorBucket(named_tensors=named)
        updater.update_weights_from_tensor({"flattened_tensor": bucket.get_flattened_tensor(),
                                            "metadata": bucket.metadata}, load_format="flattened_bucket")
    else:
        updater.update_weights_from_tensor(named, load_format="direct")
    with torch.no_grad():
        digest.update(model(torch.tensor([[1, 2, 3]])).numpy().tobytes())
    if SHAPE == "stray" and step == 1:
        with torch.no_grad():
            model.proj.bias.zero_()  # a stray write between two weight updates
print("digest", digest.hexdigest(), flush=True)
