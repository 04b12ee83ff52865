"""A realistic fine-tuning loop, unchanged: run under KVGUARD_TARGETS=autograd,weights it must report nothing.

Embedding with padding_idx and max_norm (renormalised in its forward), a transformer encoder
with dropout, weight_norm parametrization, tied input and output embeddings, gradient
accumulation under bf16 autocast, clipping, a warm-up schedule, an EMA through
AveragedModel, an eval pass, and a save and reload of the state dict.
"""
import io, warnings
warnings.simplefilter("ignore")
import torch, torch.nn as nn
torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0, max_norm=1.0)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True), 2)
        self.proj = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))
        self.head = nn.Linear(16, 50)
        self.head.weight = self.emb.weight
    def forward(self, ids):
        return self.head(self.proj(self.enc(self.emb(ids))))
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99))
ids = torch.randint(1, 50, (4, 8))
for step in range(4):
    for micro in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, 50), ids.reshape(-1)) / 2
        loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
    ema.update_parameters(model)
model.eval()
with torch.no_grad():
    model(ids)
buf = io.BytesIO(); torch.save(model.state_dict(), buf); buf.seek(0)
model.load_state_dict(torch.load(buf))
model.train()
print("ok")
