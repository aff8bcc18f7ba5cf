"""``PartialModelAverager``: local SGD whose averaging is spread over the steps (DreamDDP-style).

    averager = PartialModelAverager(period=8, warmup_steps=100)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(...), averager)

Periodic averaging (local SGD) sends the whole model every H steps, after the optimizer step,
with nothing left to overlap it with. DreamDDP's partial synchronisation (Tang et al., 2025)
averages a different 1/H of the model at every step instead, each part exactly once per period,
so the transfer can hide behind computation. Here, at the end of step t (``average_parameters``)
the slice of step t is copied and its allreduce starts; it runs during step t+1's forward and
backward, and at the end of step t+1 the average replaces the copied values while this rank's
own update of step t+1 is kept:

    theta <- average(theta_t) + (theta_now - theta_t)        on the slice of step t

(for SGD: the slice's average at t, then the local gradient step of t+1, as DreamDDP's).
``schedule`` shows which parameter elements are averaged at which step (see
:mod:`ddp.averaging.schedule`: ``"balanced"`` slices by default, ``"round_robin"`` layers as the
baseline). An averaging in flight is completed by the next call, by :meth:`finish`, by
``state_dict()`` (which then holds it, so a resumed run applies it bit for bit) and, under
``Join``, by the post hook.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, Optional, Tuple

import torch

from autograd_bridge.tensors import to_array
from commlib import ReduceOp

from ddp.averaging.averagers import ModelAverager, check_count
from ddp.averaging.schedule import STRATEGIES, Piece, plan_partial_sync
from ddp.stats import MeteredGroup

__all__ = ["PartialModelAverager"]


class _InFlight:
    """One step's slice on its way: per dtype, the copy sent (``snapshot``, None on a joined rank)
    and the buffer being averaged, with the collective's handle (None once complete)."""

    __slots__ = ("slot", "parts", "contributed")

    def __init__(self, slot: int, contributed: bool):
        self.slot = slot
        self.parts: List[Tuple[Optional[torch.Tensor], torch.Tensor, Any]] = []  # (snapshot, buffer, work)
        self.contributed = contributed

    def wait(self) -> None:
        for index, (snapshot, buffer, work) in enumerate(self.parts):
            if work is not None:
                work.wait()
                self.parts[index] = (snapshot, buffer, None)


class PartialModelAverager(ModelAverager):
    def __init__(self, period: int, warmup_steps: int = 0, process_group=None, *, schedule: str = "balanced",
                 average_buffers: bool = False, module: Optional[torch.nn.Module] = None):
        super().__init__(process_group, warmup_steps=warmup_steps, average_buffers=average_buffers, module=module)
        self.period = check_count(period, "period", type(self).__name__, 1)
        if schedule not in STRATEGIES:
            raise ValueError(f"{type(self).__name__}: schedule must be one of {STRATEGIES}, got {schedule!r}")
        self.strategy = schedule
        self._plan: Optional[List[List[Piece]]] = None
        self._sizes: Optional[List[int]] = None
        self._in_flight: Optional[_InFlight] = None

    # -- the plan ------------------------------------------------------------------------------
    def _plan_for(self, tensors: List[torch.Tensor]):
        sizes = [t.numel() for t in tensors]
        if self._plan is None or sizes != self._sizes:
            if self._in_flight is not None:
                raise RuntimeError(f"{type(self).__name__}: the parameters changed while an averaging was in "
                                   f"flight ({self._sizes} -> {sizes} elements)")
            self._plan, self._sizes = plan_partial_sync(sizes, self.period, self.strategy), sizes
        return self._plan

    @property
    def schedule(self):
        """Per step of a period: [(parameter name, first element, end element), ...] (None until
        the first call saw the parameters; names from ``module`` when given)."""
        tensors = self._tensors  # set with the plan, by the first call
        if self._plan is None or tensors is None:
            return None
        names = {}
        if self.module is not None:
            named = list(self.module.named_parameters()) + list(self.module.named_buffers())
            names = {id(t): name for name, t in named}
        label = [names.get(id(t), f"param{i}") for i, t in enumerate(tensors)]
        return [[(label[p.param], p.start, p.stop) for p in pieces] for pieces in self._plan]

    def _due_slot(self) -> Optional[int]:
        if self.step < self.warmup_steps:
            return None
        return (self.step - self.warmup_steps) % self.period

    @staticmethod
    def _views(tensors, pieces) -> "OrderedDict[tuple, list]":
        groups: "OrderedDict[tuple, list]" = OrderedDict()
        for piece in pieces:
            tensor = tensors[piece.param]
            if not tensor.is_contiguous():
                raise ValueError(f"PartialModelAverager: parameter {piece.param} is not contiguous")
            view = tensor.detach().view(-1)[piece.start:piece.stop]
            groups.setdefault((tensor.dtype, tensor.device), []).append(view)
        return groups

    # -- one step ------------------------------------------------------------------------------
    def _average(self, tensors, join, contribute) -> None:
        plan = self._plan_for(tensors)
        self._complete(tensors)
        slot = self._due_slot()
        if slot is None or not plan[slot]:
            return
        contributors = None
        if join is not None:
            contributors = join.active_count  # the ranks that ran this step: their slices are fresh
        divisor = self.process_group.size if contributors is None else contributors
        sender = MeteredGroup(self.process_group, self.sent)
        in_flight = _InFlight(slot, contribute)
        with torch.no_grad():
            for (dtype, device), views in self._views(tensors, plan[slot]).items():
                if contribute:
                    snapshot = torch.cat(views)
                    buffer = snapshot / divisor
                else:
                    snapshot, buffer = None, torch.zeros(sum(v.numel() for v in views), dtype=dtype, device=device)
                work = sender.allreduce(to_array(buffer), ReduceOp.SUM, async_op=True)
                in_flight.parts.append((snapshot, buffer, work))
        self._in_flight = in_flight

    @torch.no_grad()
    def _complete(self, tensors) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        in_flight.wait()
        if not in_flight.contributed:
            return
        plan = self._plan
        assert plan is not None  # planned before the averaging was launched
        groups = self._views(tensors, plan[in_flight.slot]).values()
        for views, (snapshot, average, _) in zip(groups, in_flight.parts):
            assert snapshot is not None  # this rank contributed
            offset = 0
            for view in views:
                # average + (now - then): exactly the average when this rank did not move.
                view.sub_(snapshot[offset:offset + view.numel()]).add_(average[offset:offset + view.numel()])
                offset += view.numel()

    def finish(self) -> None:
        """Wait for the averaging in flight and apply it (e.g. before evaluating or saving)."""
        if self._tensors is not None:
            self._complete(self._tensors)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The step, the plan's inputs and the averaging in flight (waited for: it holds the result)."""
        state = {"step": self.step, "period": self.period, "strategy": self.strategy, "sizes": self._sizes,
                 "in_flight": None}
        if self._in_flight is not None:
            self._in_flight.wait()
            state["in_flight"] = {
                "slot": self._in_flight.slot, "contributed": self._in_flight.contributed,
                "parts": [(None if s is None else s.clone(), b.clone()) for s, b, _ in self._in_flight.parts]}
        return state

    def load_state_dict(self, state: dict) -> None:
        if (state["period"], state["strategy"]) != (self.period, self.strategy):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the checkpoint has period={state['period']}, "
                             f"schedule={state['strategy']!r}; this averager {self.period}, {self.strategy!r}")
        self.step = int(state["step"])
        self._sizes = state["sizes"]
        self._plan = None if self._sizes is None else plan_partial_sync(self._sizes, self.period, self.strategy)
        self._in_flight = None
        saved = state["in_flight"]
        if saved is not None:
            in_flight = _InFlight(saved["slot"], saved["contributed"])
            in_flight.parts = [(s, b, None) for s, b in saved["parts"]]
            self._in_flight = in_flight
