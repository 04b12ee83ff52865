"""kvguard: catch in-place writes to tensors that someone else still relies on.

    import kvguard

    with kvguard.guard(rollout_data, action="raise") as g:
        compute_advantages_and_returns(args, rollout_data)

Importing kvguard does not import torch; the engine loads when a guard is entered.
"""

from kvguard._errors import ConfigError as ConfigError
from kvguard._errors import GuardWarning as GuardWarning
from kvguard._report.events import MutationError as MutationError
from kvguard._report.events import MutationWarning as MutationWarning
from kvguard._guard.allow import allow as allow
from kvguard._guard.autograd import guard_autograd as guard_autograd
from kvguard._guard.data import guard_data as guard_data
from kvguard._guard.module import guard_module as guard_module
from kvguard._guard.calls import guarded as guarded
from kvguard._guard.guard import Guard as Guard
from kvguard._guard.guard import guard as guard
from kvguard._report.events import GuardReport as GuardReport
from kvguard._report.events import MutationEvent as MutationEvent

__version__ = "0.2.0"
__all__ = ["ConfigError", "Guard", "GuardReport", "GuardWarning", "MutationError", "MutationEvent",
           "MutationWarning", "allow", "guard", "guard_autograd", "guard_data", "guard_module", "guarded"]

# Re-exports look native: tracebacks and reprs say kvguard.MutationError.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
