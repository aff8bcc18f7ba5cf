"""``DESLOC``: desynced low-communication Adam (Iacob et al., arXiv 2505.22549).

    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ddp.DESLOC(model, adam, sync_every=(16, 48, 96)):      # (Kx, Ku, Kv)
        ...; loss.backward(); adam.step()

Every rank runs Adam on its own data; right after inner step ``t`` each quantity whose period
divides ``t`` is replaced by its average over the ranks: the parameters when ``t % Kx == 0``, the
first moment ``exp_avg`` when ``t % Ku == 0``, the second moment ``exp_avg_sq`` when
``t % Kv == 0`` (the paper recommends ``Ku = 3 Kx``, ``Kv = 6 Kx``: a moment that decays slowly
drifts slowly). What is due is averaged as :func:`ddp.averaging.utils.average_tensors` does
(large tensors in place, the small ones of a dtype in one buffer). An integer
``sync_every=K`` is Local Adam (everything every ``K`` steps). Adam's ``step`` count is the same
on every rank and is not sent.

Cost: ``bytes_sent`` grows by ``N s`` (``N`` parameters of ``s`` bytes) for each quantity due,
``N s (1/Kx + 1/Ku + 1/Kv)`` per step on average against DDP's ``N s``.

Against DDP + Adam on the averaged gradient, with ``Kx = Ku = Kv = 1`` and every rank starting
from the same state (tested in ``tests/mpi/low_communication_ranks.py``):

* the first moment is linear in the gradient, so after a step the averaged ``exp_avg`` is DDP's
  exactly when the ranks' previous ``exp_avg`` were equal (at every step where, in addition, the
  parameters were equal before the step: at the first step, and always when the data are the same);
* the second moment is not: the averaged ``exp_avg_sq`` exceeds DDP's by ``(1 - beta2)`` times the
  variance of the gradients across ranks (the mean of squares against the square of the mean);
* the parameters are not either: Adam's update ``m / (sqrt(v) + eps)`` is not linear, so the
  average of the ranks' updates is not DDP's update, and from the second step the gradients are
  taken at different points;
* with the same data on every rank all three equal DDP + Adam at every step (up to the rounding
  of the division by P).

The optimizer must be torch's ``Adam``, ``AdamW``, ``NAdam`` or ``RAdam`` without ``amsgrad`` (a
maximum of second moments is not averaged by the method). Warm-up, DDP, Join and bytes:
:mod:`ddp.low_communication.base`; :meth:`state_dict` holds the step (the optimizer's state is
the user's to checkpoint, with the model).
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from ddp.averaging.averagers import check_count
from ddp.averaging.utils import average_tensors
from ddp.join import Join
from ddp.low_communication.base import LowCommunication

__all__ = ["DESLOC"]

ADAMS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)
QUANTITIES = ("parameters", "exp_avg", "exp_avg_sq")


class DESLOC(LowCommunication):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 sync_every: Union[int, Tuple[int, int, int]] = (16, 48, 96), *, warmup_steps: int = 0,
                 process_group=None, algorithm: str = "auto"):
        if not isinstance(optimizer, ADAMS):
            raise TypeError(f"DESLOC: the optimizer must be one of torch's {[a.__name__ for a in ADAMS]} (it keeps "
                            f"exp_avg and exp_avg_sq), got {type(optimizer).__name__}")
        if any(group.get("amsgrad") for group in optimizer.param_groups):
            raise ValueError("DESLOC: amsgrad=True keeps a running maximum of the second moment, which DES-LOC does "
                             "not average; use amsgrad=False")
        periods = (sync_every,) * 3 if isinstance(sync_every, int) and not isinstance(sync_every, bool) else sync_every
        if not isinstance(periods, (tuple, list)) or len(periods) != 3:
            raise ValueError(f"DESLOC: sync_every must be (Kx, Ku, Kv) or one integer, got {sync_every!r}")
        self.sync_every: Tuple[int, int, int] = tuple(  # type: ignore[assignment]
            check_count(k, f"the period of {name}", "DESLOC", 1) for k, name in zip(periods, QUANTITIES))
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        super().__init__(model, optimizer, params, warmup_steps=warmup_steps, process_group=process_group,
                         algorithm=algorithm)
        self._states_checked = False

    def due(self, t: int) -> List[str]:
        """What is averaged right after low-communication step ``t``."""
        return [name for name, period in zip(QUANTITIES, self.sync_every) if t >= 1 and t % period == 0]

    def _moments(self, names: List[str]) -> List[torch.Tensor]:
        state = self.optimizer.state
        if not self._states_checked:
            missing = [i for i, p in enumerate(self.params) if not all(n in state.get(p, {}) for n in QUANTITIES[1:])]
            self.check_everywhere(None if not missing else (
                f"DESLOC (rank {self.process_group.rank}): parameters {missing[:8]} of the optimizer have no Adam "
                f"state (no gradient in any step so far); every parameter must have taken a step before its "
                f"moments are averaged"))
            self._states_checked = True
        return [state[p][name] for name in names for p in self.params]

    def _on_step(self, join: Optional[Join], contribute: bool) -> None:
        due = self.due(self.step - self.warmup_steps)
        if not due:
            return
        tensors: List[torch.Tensor] = list(self.params) if "parameters" in due else []
        moments = [name for name in due if name != "parameters"]
        if moments:
            tensors += self._moments(moments)
        # In place where large (no copy), the small ones of a dtype in one buffer: ddp.averaging's way.
        with self.waiting():
            average_tensors(tensors, self.process_group, contributors=self.divisor(join), contribute=contribute,
                            counter=self.sent, algorithm=self.algorithm)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["sync_every"] = list(self.sync_every)
        return state

    def load_state_dict(self, state: dict) -> None:
        if tuple(state.get("sync_every", ())) != self.sync_every:
            raise ValueError(f"DESLOC.load_state_dict: the checkpoint has sync_every={state.get('sync_every')}, "
                             f"this DESLOC {self.sync_every}")
        super().load_state_dict(state)
