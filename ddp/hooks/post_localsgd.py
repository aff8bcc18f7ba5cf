"""Post-local SGD (Lin et al., ICLR 2020) as a DDP comm hook, torch's API.

    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
    model.register_comm_hook(state, post_localSGD_hook)
    averager = PeriodicModelAverager(period=8, warmup_steps=100)     # ddp.averaging
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(...), averager)  # ddp.optim

For the first ``start_localSGD_iter`` iterations the hook averages gradients over the whole
group (plain DDP); from then on over ``subgroup`` only (by default the ranks of this host, so no
gradient crosses the slow link), or not at all with ``post_local_gradient_allreduce=False``;
the model averager then averages parameters over everyone every few steps.

Beyond torch: the averager's ``warmup_steps`` must equal ``start_localSGD_iter`` (torch leaves
a silent gap of unsynchronised steps when they differ): a DDP model registers this state's
parameters, and an averager of those parameters raises ``ValueError`` on its first call if the
two disagree. The default subgroup is created when the state is (collectively, on every rank),
not from inside backward. ``state_dict()`` carries the iteration.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch

from commlib import ReduceOp, WorkHandle

from ddp.hooks.default import CompletedWork, GradBucket
from ddp.subgroups import host_subgroup

__all__ = ["PostLocalSGDState", "post_localSGD_hook", "check_warmup_agrees"]

_LIVE_STATES: "weakref.WeakSet[PostLocalSGDState]" = weakref.WeakSet()


class PostLocalSGDState:
    """``process_group``: the global group (None: the DDP model's, or commlib's world for the
    default subgroup); ``subgroup``: the group of the local phase (None: this host's ranks);
    ``start_localSGD_iter``: iterations of plain DDP first; ``post_local_gradient_allreduce``:
    average gradients within ``subgroup`` in the local phase (False: purely local steps)."""

    def __init__(self, process_group, subgroup, start_localSGD_iter, post_local_gradient_allreduce=True):
        if isinstance(start_localSGD_iter, bool) or not isinstance(start_localSGD_iter, int) or start_localSGD_iter < 0:
            raise ValueError(f"PostLocalSGDState: start_localSGD_iter must be an integer >= 0, "
                             f"got {start_localSGD_iter!r}")
        self.process_group = process_group
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = bool(post_local_gradient_allreduce)
        if subgroup is None and self.post_local_gradient_allreduce:
            if process_group is None:
                import commlib

                process_group = commlib.world()
            subgroup, _ = host_subgroup(process_group)
        self.subgroup = subgroup
        self.iter = 0
        self._params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # by id()
        _LIVE_STATES.add(self)

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def on_register(self, model) -> None:
        """Called by ``DistributedDataParallel.register_comm_hook``: remember whose gradients
        this state reduces, so an averager of the same parameters can check its warm-up."""
        for param in model.parameters():
            self._params[id(param)] = param

    def state_dict(self) -> dict:
        return {"iter": self.iter, "start_localSGD_iter": self.start_localSGD_iter,
                "post_local_gradient_allreduce": self.post_local_gradient_allreduce}

    def load_state_dict(self, state: dict) -> None:
        if state["start_localSGD_iter"] != self.start_localSGD_iter:
            raise ValueError(f"PostLocalSGDState.load_state_dict: the checkpoint has start_localSGD_iter="
                             f"{state['start_localSGD_iter']}, this state {self.start_localSGD_iter}")
        self.iter = int(state["iter"])


def post_localSGD_hook(state: PostLocalSGDState, bucket: GradBucket) -> WorkHandle:
    """Average over the global group before ``start_localSGD_iter``, over the subgroup after."""
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        group = bucket.metered(state.process_group) if state.process_group is not None else bucket.process_group
        return group.allreduce(bucket.array(), ReduceOp.AVG, algorithm=bucket.algorithm, async_op=True)
    if not state.post_local_gradient_allreduce or state.subgroup.size == 1:
        return CompletedWork(bucket.buffer())
    return bucket.metered(state.subgroup).allreduce(bucket.array(), ReduceOp.AVG, algorithm=bucket.algorithm,
                                                    async_op=True)


def check_warmup_agrees(params: Iterable[torch.Tensor], warmup_steps: int, who: str) -> None:
    """Raise if a post-local SGD state reduces any of ``params`` with another start than ``warmup_steps``."""
    params = list(params)
    for state in list(_LIVE_STATES):
        ours = any(state._params.get(id(p)) is p for p in params)
        if ours and state.start_localSGD_iter != warmup_steps:
            raise ValueError(
                f"{who}: warmup_steps={warmup_steps}, but the post-local SGD hook of these parameters "
                f"starts local steps at start_localSGD_iter={state.start_localSGD_iter}; they must be "
                f"equal, or {abs(state.start_localSGD_iter - warmup_steps)} steps would "
                + ("neither average gradients nor parameters" if warmup_steps > state.start_localSGD_iter
                   else "average both gradients and parameters"))
