"""The optimizer of a fault-tolerant replica: steps only what its quorum committed.

``zero_grad()`` opens the step (joining a quorum, and catching up, if needed); ``step()`` runs the
manager's gradient hooks (the model wrapper's average over the quorum), asks the manager whether
the step commits, and applies the wrapped optimizer's step only then. A discarded step leaves
the parameters and the optimizer's state exactly as they were, so the training loop stays as
it is: the next iteration redoes the step with the next quorum. Torch is never imported here:
the wrapped optimizer is used through its methods.
"""

from __future__ import annotations

__all__ = ["OptimizerWrapper"]


class OptimizerWrapper:
    """``manager.optimizer(optim)`` (see the module docstring). Its state (``state_dict``) is
    registered with the manager, so a joiner receives it with the model."""

    def __init__(self, manager, optim):
        self.manager = manager
        self.optim = optim
        manager.register_state("optimizer", optim.state_dict, optim.load_state_dict)

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_step()
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> bool:
        """True when the step committed (and was applied)."""
        self.manager.start_step()
        if not self.manager.should_commit():
            return False
        if closure is not None:
            self.optim.step(closure)
        else:
            self.optim.step()
        return True

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optim.load_state_dict(state_dict)
