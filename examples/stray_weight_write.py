"""A training loop whose weights something else overwrites between steps.

    KVGUARD=raise KVGUARD_TARGETS=weights python examples/stray_weight_write.py

stops at the stray write with the parameter's name; without kvguard the loop runs on, and
the model silently trains from the corrupted weights.
"""
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data, target = torch.randn(32, 8), torch.randn(32, 1)


def log_weight_norms(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.data.div_(p.norm())  # meant to compute a normalised copy for logging; writes the weight


for step in range(3):
    loss = torch.nn.functional.mse_loss(model(data), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    log_weight_norms(model)
print("trained")
