"""The inference side of RL, no optimizer: run under KVGUARD_TARGETS=weights with a shape name.

- lora_ipc_buffer (verl #6688): LoRA weights loaded as views into a reused IPC receive
  buffer; the next bucket lands in the same buffer.
- aliased_buffer (prime-rl #2482): a buffer aliasing a parameter; a stale `copy_` into it
  over freshly reloaded weights.
- sync_scope: a weight sync named in KVGUARD_ALLOW writes the weights (intended), then a
  stray write between syncs.
- clean: reloads and syncs only.
"""
import sys

import torch


class LoraLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lora_A = torch.nn.Parameter(torch.zeros(2, 4))
        self.lora_B = torch.nn.Parameter(torch.zeros(4, 2))
        self.register_buffer("packed_A", self.lora_A.data.view(8), persistent=False)  # an alias


def receive(buffer: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
    buffer[: bucket.numel()].copy_(bucket)  # an IPC receive into a reused buffer
    return buffer


def sync_weights(model: torch.nn.Module, new: dict) -> None:  # the weight sync KVGUARD_ALLOW names
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new[name])


shape = sys.argv[1]
rollout_model = LoraLinear()
buffer = torch.empty(16)
receive(buffer, torch.arange(16.0))
if shape == "lora_ipc_buffer":
    rollout_model.load_state_dict({"lora_A": buffer[:8].view(2, 4), "lora_B": buffer[8:].view(4, 2)}, assign=True)
    receive(buffer, torch.full((16,), -1.0))  # the next bucket overwrites the loaded LoRA weights
elif shape == "aliased_buffer":
    rollout_model.load_state_dict({"lora_A": torch.ones(2, 4), "lora_B": torch.ones(4, 2)})
    rollout_model.packed_A.copy_(torch.full((8,), 7.0))  # stale data over the reload
elif shape == "sync_scope":
    rollout_model.load_state_dict({"lora_A": torch.ones(2, 4), "lora_B": torch.ones(4, 2)})
    sync_weights(rollout_model, {"lora_A": torch.full((2, 4), 2.0), "lora_B": torch.full((4, 2), 2.0)})
    with torch.no_grad():
        rollout_model.lora_B.mul_(0)  # a stray write between syncs
else:
    rollout_model.load_state_dict({"lora_A": torch.ones(2, 4), "lora_B": torch.ones(4, 2)})
    sync_weights(rollout_model, {"lora_A": torch.full((2, 4), 2.0), "lora_B": torch.full((4, 2), 2.0)})
    rollout_model.load_state_dict({"lora_A": torch.ones(2, 4), "lora_B": torch.ones(4, 2)})
print("done", flush=True)
