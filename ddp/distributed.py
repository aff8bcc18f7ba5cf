"""``DistributedDataParallel``: the module wrapper users see; the policy lives in the reducer."""

from __future__ import annotations

import contextlib
import numbers
from typing import Optional

import torch

import commlib

from ddp.bucketing import MiB
from ddp.hooks import CommHook
from ddp.join import Join, Joinable, JoinHook
from ddp.reducer import Reducer
from ddp.verify import broadcast_tensors, verify_same_parameters

__all__ = ["DistributedDataParallel"]


def _check_cap(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise ValueError(f"DistributedDataParallel: {name} must be a positive number of MiB, got {value!r}")
    return float(value)


class DistributedDataParallel(torch.nn.Module, Joinable):
    """Data parallelism over a commlib process group (Li et al., VLDB 2020).

    ``model = DistributedDataParallel(net)``: at construction every rank checks that all ranks
    have the same parameters (count, then shape/dtype/device; a clear error on every rank names
    the differing rank and parameter) and takes rank 0's parameters and buffers. Each backward
    then leaves ``.grad`` averaged over the ranks, reduced bucket by bucket while backward runs.

    Arguments: ``process_group`` (default ``commlib.world()``), ``bucket_cap_mb`` /
    ``first_bucket_cap_mb`` (bucket sizes, MiB), ``find_unused_parameters`` (walk the autograd
    graph after each forward; parameters it cannot reach count as ready; a parameter no rank used
    keeps its ``.grad`` untouched), ``broadcast_buffers`` (rank 0's buffers before each forward),
    ``gradient_as_bucket_view`` (``.grad`` becomes a view of the bucket: no copies, no second
    gradient-sized buffer), ``algorithm`` (commlib allreduce algorithm), ``tracer`` (an object with
    ``instant(name, lane, ts, args)`` and ``span(name, lane, start, end, args)``).

    Defined behaviours at the edges:

    * Forward twice, then one backward: allowed; the last forward's preparation counts (with
      ``find_unused_parameters``, its graph decides which parameters are unused). Gradients of a
      parameter reached from both outputs are reduced once.
    * Backward of a graph no DDP forward prepared (``model.module(x)``, or a second backward
      through a retained graph after the first one was reduced): ``RuntimeError`` from
      ``backward()`` naming the parameter, because the gradient would silently not be averaged.
      Inside ``no_sync()`` there is nothing to reduce, so no error.
    * A parameter with no gradient when backward ends (without ``find_unused_parameters``):
      ``RuntimeError`` from ``backward()`` naming the parameters; the buckets already launched are
      waited for first, so the group stays usable. If backward itself failed midway, the next
      forward raises instead.
    * A collective that fails on the communication thread: its exception is raised from
      ``backward()`` (or from the next forward if backward did not reach its end).
    * Uneven inputs: ``with model.join():`` (or ``ddp.Join([model, ...])``) lets ranks that ran
      out of data shadow the others' collectives (see :mod:`ddp.join`).
    """

    def __init__(self, module: torch.nn.Module, process_group=None, *, bucket_cap_mb: float = 25,
                 first_bucket_cap_mb: float = 1, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, gradient_as_bucket_view: bool = False,
                 algorithm: str = "auto", tracer=None):
        super().__init__()
        Joinable.__init__(self)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DistributedDataParallel: expected a torch.nn.Module, got {type(module).__name__}")
        cap = _check_cap(bucket_cap_mb, "bucket_cap_mb")
        first_cap = _check_cap(first_bucket_cap_mb, "first_bucket_cap_mb")
        if not isinstance(algorithm, str):
            raise TypeError(f"DistributedDataParallel: algorithm must be a str, got {algorithm!r}")
        self.module = module
        self.process_group = process_group if process_group is not None else commlib.world()
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.algorithm = algorithm
        self._require_sync = True
        self._divide_by_initial_world_size = True

        named = list(module.named_parameters())
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"DistributedDataParallel: the module's parameters live on several "
                             f"devices {sorted(map(str, devices))}; expected one device per process")
        verify_same_parameters(self.process_group, named)
        self._buffers_to_sync = list(module.buffers())
        broadcast_tensors(self.process_group, [p.data for _, p in named] + self._buffers_to_sync)

        trainable = [(n, p) for n, p in named if p.requires_grad]
        self.reducer = Reducer([p for _, p in trainable], [n for n, _ in trainable], self.process_group,
                               cap_bytes=cap * MiB, first_cap_bytes=first_cap * MiB,
                               gradient_as_bucket_view=self.gradient_as_bucket_view,
                               find_unused_parameters=self.find_unused_parameters,
                               algorithm=algorithm, tracer=tracer)

    # -- training ------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        self.reducer.check_previous_backward()
        join = Join.notify_join_context(self, syncs=self._require_sync and torch.is_grad_enabled())
        if join is not None and not self._divide_by_initial_world_size:
            self.reducer.set_divisor(join.active_count)
        if self.broadcast_buffers and self._buffers_to_sync:
            broadcast_tensors(self.process_group, self._buffers_to_sync,
                              root=join.source_rank() if join is not None else 0)
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():
            self.reducer.prepare(output, sync=self._require_sync)
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Forward and backward inside accumulate gradients locally, without communication."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def register_comm_hook(self, state, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)``, which returns a :class:`commlib.WorkHandle`
        or a ``torch.futures.Future`` (see :mod:`ddp.hooks`).

        A ``state`` with an ``on_register(model)`` method is told which model it serves."""
        self.reducer.set_comm_hook(state, hook)
        on_register = getattr(state, "on_register", None)
        if callable(on_register):
            on_register(self)

    # -- uneven inputs (ddp.join) --------------------------------------------------------------
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """``with model.join():`` around the training loop, for ranks with different numbers of batches."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, divide_by_initial_world_size: bool = True, **kwargs) -> DDPJoinHook:
        self._divide_by_initial_world_size = bool(divide_by_initial_world_size)
        return DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        first = next(iter(self.module.parameters()), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def join_process_group(self):
        return self.process_group

    # -- introspection -------------------------------------------------------------------------
    def last_step_stats(self) -> Optional[dict]:
        """Of the last synchronised backward: ``comm_s``, ``overlapped_comm_s``, ``hidden_fraction``..."""
        return self.reducer.last_stats()

    def bucket_sizes(self):
        """Bytes of each bucket buffer DDP allocated (its extra memory for gradients)."""
        return self.reducer.bucket_sizes()

    def bucket_plan(self):
        """Parameter indices (order of ``parameters()`` that require grad) of each bucket."""
        return [bucket.params for bucket in self.reducer.buckets]


class DDPJoinHook(JoinHook):
    """What a joined rank does for our DDP (see :mod:`ddp.join`): the collectives of one forward and
    one backward of the others, with nothing of its own to contribute, and the final model at the
    end. Here, beside the model, because it reads the model's join state."""

    def __init__(self, model):
        self.model = model

    def main_hook(self) -> None:
        model = self.model
        join = model._join_config.context
        # Forward: the buffer broadcast every active rank issues (from the lowest active rank).
        if model.broadcast_buffers and model._buffers_to_sync:
            broadcast_tensors(model.process_group, model._buffers_to_sync, root=join.source_rank())
        # Backward: every bucket with zero gradients (the sum over the active ranks is theirs
        # alone), unless the active ranks run no_sync() this iteration.
        if join.any_active_syncs():
            model.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        model = self.model
        model.reducer.set_divisor(None)
        # Joined ranks stopped stepping: everyone takes the model of one of the last to join.
        source = Join.last_joiner_rank(model.process_group, is_last_joiner)
        broadcast_tensors(model.process_group, [p.data for p in model.module.parameters()]
                          + list(model.module.buffers()), root=source)
