"""The actor imports the loss function by name, as RL frameworks do (`from .loss import fn`).

kvguard rebinds such names too, so the guarded function is what the actor calls.
"""

from trainer_loss import compute_advantages_and_returns  # noqa: F401
