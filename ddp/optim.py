"""``PostLocalSGDOptimizer``: an optimizer step followed by the model averager (torch's API).

    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      PeriodicModelAverager(period=8, warmup_steps=100))

``step()`` runs the wrapped optimizer's step, then ``averager.average_parameters`` on its
parameter groups. ``state_dict()`` is the wrapped optimizer's plus ``"step"`` (the averager's
step, as torch's) and ``"averager"`` (the averager's whole state: a partial averager's
averaging in flight), so a resumed run continues exactly. The averager's ``warmup_steps`` is
checked here against a post-local SGD hook of the same parameters (torch leaves a gap).
"""

from __future__ import annotations

import warnings

import torch

from ddp.hooks.post_localsgd import check_warmup_agrees

__all__ = ["PostLocalSGDOptimizer"]


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    def __init__(self, optim: torch.optim.Optimizer, averager):
        # Not Optimizer.__init__: the wrapped optimizer owns the state and the parameter groups.
        self.optim = optim
        self.param_groups = optim.param_groups
        self.averager = averager
        check_warmup_agrees([p for group in optim.param_groups for p in group["params"]],
                            averager.warmup_steps, "PostLocalSGDOptimizer")

    @property
    def state(self):  # type: ignore[override]  # the wrapped optimizer's, even after it replaced its dict
        return self.optim.state

    @property
    def defaults(self):  # type: ignore[override]  # the wrapped optimizer's
        return self.optim.defaults

    def __repr__(self) -> str:
        return f"PostLocalSGDOptimizer({self.optim!r}, {type(self.averager).__name__})"

    def state_dict(self) -> dict:
        state = self.optim.state_dict()
        state["step"] = self.averager.step
        state["averager"] = self.averager.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        step = state_dict.pop("step", None)
        averager_state = state_dict.pop("averager", None)
        self.optim.load_state_dict(state_dict)
        if averager_state is not None:
            self.averager.load_state_dict(averager_state)
        elif step is not None:
            self.averager.step = int(step)
        else:
            warnings.warn("PostLocalSGDOptimizer.load_state_dict: no 'step' in the state dict; the averager "
                          "starts again from step 0 (warm-up included)", stacklevel=2)
            self.averager.step = 0

    def step(self, closure=None):
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self.averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.optim.add_param_group(param_group)
