"""verl #2484: Megatron's vocab-parallel cross-entropy writes fp32 logits in place that an entropy saved."""
import os, sys
import torch, torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel()
torch.manual_seed(0)
hidden = torch.randn(4, 2, 16)
head = torch.nn.Linear(16, 32)
logits = head(hidden).float()                      # fp32 already: .float() inside is a no-op
log_probs = torch.log_softmax(logits, dim=-1)      # the entropy path saves the logits' result ...
entropy = -(log_probs.exp() * log_probs).sum(-1)   # ... and exp saves its result
probs = torch.softmax(logits, dim=-1)              # saves its result too
entropy2 = (probs * logits).sum(-1)                # mul saves logits
labels = torch.randint(0, 32, (4, 2))
fixed = sys.argv[1] == "fixed"
loss = vocab_parallel_cross_entropy(logits.clone() if fixed else logits, labels)
(loss.mean() - entropy.mean() - entropy2.mean()).backward()
print("backward ok", flush=True)
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
