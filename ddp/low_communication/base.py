"""What DiLoCo and DES-LOC share: hooking an optimizer's step, the warm-up, DDP, Join, bytes.

    with ddp.DiLoCo(model, inner, outer, sync_every=50):      # or ddp.DESLOC(model, adam, ...)
        for x, y in batches:
            inner.zero_grad(); loss_fn(model(x), y).backward(); inner.step()

Entering the context registers a pre- and a post-hook on the optimizer's ``step`` (torch's
``register_step_pre_hook`` / ``register_step_post_hook``), leaving it removes them: the training
loop stays as it was. ``step`` counts the optimizer steps taken inside (it goes on counting if
the same object is entered again); the first ``warmup_steps`` of them are left alone, after
which ``t = step - warmup_steps`` numbers the low-communication steps from 1.

Starting point. Every rank must start the low-communication phase from the same parameters.
Before step ``t = 1`` they are taken from rank 0 (one broadcast, not counted in ``bytes_sent``)
unless ``model`` is our :class:`ddp.DistributedDataParallel`, whose construction and warm-up
steps keep them equal already; a state loaded with ``load_state_dict`` has started already.

DDP. Given our DDP model, its gradients must stop being averaged when the local steps begin: if
it has no comm hook, the post-local SGD hook (``start_localSGD_iter=warmup_steps``, no gradient
allreduce afterwards) is registered here, so the ``warmup_steps`` first steps are plain
synchronous DDP; a post-local SGD hook registered by the user must start at ``warmup_steps``
(it may average gradients within a subgroup afterwards: the ranks of a host as one worker);
any other hook is refused.

Join. The object is a :class:`ddp.Joinable`: list it after the model, ``Join([model, diloco])``,
or alone, ``Join([diloco])`` (then its pre-hook starts each iteration, one small allgather per
step, as torch's Join costs). A rank that ran out of data sends zeros in the others'
synchronisations, which divide by the number of ranks still in (DiLoCo's also applies what it
receives, so its copy of the global state stays the others'; DES-LOC's keeps its own state, which
the next averages mix in); when every rank has joined, all take the parameters of one of the last
to join.

Bytes. ``bytes_sent`` is the payload this object handed to collectives (the wire dtype's bytes),
what the methods' formulas count; Join's allgather and the starting broadcast are not in it.

Time. ``waited_seconds`` is how long the training loop stood still waiting for this object's
synchronisations (a blocking average, or the wait for one in flight): what overlap did not hide.
"""

from __future__ import annotations

import abc
import contextlib
import time
from typing import Iterator, List, Optional

import numpy as np
import torch

from commlib import ReduceOp

from ddp.averaging.averagers import check_count
from ddp.distributed import DistributedDataParallel
from ddp.hooks import PostLocalSGDState, allreduce_hook, post_localSGD_hook
from ddp.hooks.post_localsgd import check_warmup_agrees
from ddp.join import Join, Joinable, JoinHook
from ddp.stats import ByteCounter
from ddp.verify import broadcast_tensors

__all__ = ["LowCommunication"]


class LowCommunication(Joinable, abc.ABC):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: List[torch.Tensor], *,
                 warmup_steps: int, process_group, algorithm: str):
        Joinable.__init__(self)
        who = type(self).__name__
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{who}: the optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(algorithm, str):
            raise TypeError(f"{who}: algorithm must be a str, got {algorithm!r}")
        self.model = model
        self.optimizer = optimizer
        self.warmup_steps = check_count(warmup_steps, "warmup_steps", who, 0)
        self.algorithm = algorithm
        self.is_ddp = isinstance(model, DistributedDataParallel)
        if process_group is None:
            if self.is_ddp:
                process_group = model.process_group
            else:
                import commlib

                process_group = commlib.world()
        self.process_group = process_group
        self.params = params  # what the method synchronises, in the same order on every rank
        if not self.params:
            raise ValueError(f"{who}: no parameter that requires grad to synchronise")
        self.step = 0
        self.started = False  # the ranks' starting point is agreed (see the module docstring)
        self.sent = ByteCounter()
        self.waited_seconds = 0.0
        self._handles: list = []
        self.ddp_hook_state: Optional[PostLocalSGDState] = self._local_steps_in_ddp()

    def _local_steps_in_ddp(self) -> Optional[PostLocalSGDState]:
        model, who = self.model, type(self).__name__
        if not isinstance(model, DistributedDataParallel):
            return None
        reducer = model.reducer
        hook_state: object = reducer.comm_hook_state
        if reducer.comm_hook is allreduce_hook and hook_state is None:
            state = PostLocalSGDState(model.process_group, None, self.warmup_steps,
                                      post_local_gradient_allreduce=False)
            model.register_comm_hook(state, post_localSGD_hook)
            return state
        if not isinstance(hook_state, PostLocalSGDState):
            raise ValueError(f"{who}: the DDP model has the comm hook {getattr(reducer.comm_hook, '__name__', '?')}; "
                             f"inner steps must be local: leave DDP's default hook (the post-local SGD hook is "
                             f"then registered here) or register post_localSGD_hook yourself")
        check_warmup_agrees(self.params, self.warmup_steps, who)
        return None  # the user's: the user checkpoints it

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this object has handed to collectives so far."""
        return self.sent.total

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Within: the training loop waits for a synchronisation (added to ``waited_seconds``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.waited_seconds += time.perf_counter() - start

    @property
    def local_step(self) -> int:
        """``t``: low-communication steps taken so far (0 during the warm-up)."""
        return max(0, self.step - self.warmup_steps)

    # -- the context and the hooks -------------------------------------------------------------
    def __enter__(self):
        if self._handles:
            raise RuntimeError(f"{type(self).__name__}: already entered; a context is entered once at a time")
        self._handles = [self.optimizer.register_step_pre_hook(self._before_step),
                         self.optimizer.register_step_post_hook(self._after_step)]
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if exc_type is None:
            self.finish()
        return None

    def _before_step(self, optimizer, args, kwargs) -> None:
        join = Join.notify_join_context(self)
        self._maybe_start(join)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        self._on_step(self._join_config.context, contribute=True)

    def _shadow(self) -> None:
        """A joined rank's part of one step of the others."""
        join = self._join_config.context
        self._maybe_start(join)
        self.step += 1
        self._on_step(join, contribute=False)

    def _maybe_start(self, join: Optional[Join]) -> None:
        if self.started or self.step < self.warmup_steps:
            return
        if not self.is_ddp:
            root = join.source_rank() if join is not None else 0
            broadcast_tensors(self.process_group, [p.data for p in self.params], root=root)
        self._start()
        self.started = True

    def divisor(self, join: Optional[Join]) -> int:
        """How many ranks contribute to a synchronisation this step."""
        return join.active_count if join is not None else self.process_group.size

    def check_everywhere(self, problem: Optional[str]) -> None:
        """Raise on every rank if ``problem`` (a message, or None) is set on any rank."""
        flag = np.array([0 if problem is None else 1], np.int64)
        self.process_group.allreduce(flag, ReduceOp.MAX)
        if flag[0]:
            raise RuntimeError(problem or f"{type(self).__name__} (rank {self.process_group.rank}): another rank "
                               f"found a problem (see its message)")

    def _start(self) -> None:
        """The parameters are the same everywhere: take what the method needs from them."""

    @abc.abstractmethod
    def _on_step(self, join: Optional[Join], contribute: bool) -> None:
        """Right after step ``self.step``: the synchronisations due now."""

    def finish(self) -> None:
        """Wait for any synchronisation in flight (it is applied at its step, not now)."""

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"method": type(self).__name__, "step": self.step, "started": self.started,
                 "warmup_steps": self.warmup_steps}
        if self.ddp_hook_state is not None:
            state["ddp_hook"] = self.ddp_hook_state.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        who = type(self).__name__
        if state.get("method") != who or state["warmup_steps"] != self.warmup_steps:
            raise ValueError(f"{who}.load_state_dict: the checkpoint is of {state.get('method')} with warmup_steps="
                             f"{state.get('warmup_steps')}; this is {who} with warmup_steps={self.warmup_steps}")
        self.step = int(state["step"])
        self.started = bool(state["started"])
        if self.ddp_hook_state is not None and "ddp_hook" in state:
            self.ddp_hook_state.load_state_dict(state["ddp_hook"])

    # -- Join ----------------------------------------------------------------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.params[0].device

    @property
    def join_process_group(self):
        return self.process_group


class _JoinHook(JoinHook):
    def __init__(self, method: LowCommunication):
        self.method = method

    def main_hook(self) -> None:
        self.method._shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        method = self.method
        method.finish()
        source = Join.last_joiner_rank(method.process_group, is_last_joiner)
        broadcast_tensors(method.process_group, [p.data for p in method.params], root=source)
