"""``FaultTolerantDDP``: data parallelism across replicas that may die and come back.

    manager = commlib.ft.Manager("coordinator:29600", replica_id="host-a")
    model = FaultTolerantDDP(net, manager)
    opt = manager.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

Forward is the module's. The gradients are averaged over the step's quorum when the optimizer
steps (one flat buffer, weighted by each replica's share of the step's samples, then the
manager's allreduce): the average must wait for the commit decision anyway, and one buffer
keeps the replay of a run exact. The model's state (parameters and buffers) is registered with
the manager for catch-up, and this module gives the manager its codec: ``torch.save`` /
``torch.load(weights_only=True)``, which never runs code a peer sent.

``fault_tolerant_torch_ddp(module, manager)`` is the same over torch's own
``DistributedDataParallel`` (its reducer, buckets and options), and ``fault_tolerant_ddp`` over
ours (:class:`ddp.DistributedDataParallel`), each with a communication hook
(:func:`manager_comm_hook`) that averages the buckets over the quorum; the step still commits or
is discarded at ``opt.step()``. The DDP's group is the replica's own ranks: one process, or the
ranks of a replica of several (``Manager(local_group=...)``, data parallel inside, each rank on
its :meth:`~commlib.ft.Manager.local_batch_indices`), whose gradients the hook averages over the
replica first, as ``FaultTolerantDDP`` does. The buckets are averaged together when the last one
is ready (see :class:`ManagerHookState` for why not one by one), so the average does not overlap
backward, and it is ``FaultTolerantDDP``'s average bit for bit. With a hook every rank of a
replica must run backward each step, also one whose part of the share is empty (a loss of
zero over its empty batch, e.g. ``model(batch).sum()``): torch's DDP and ours call the hook from
backward, and the replica's average waits for every rank.

``FaultTolerantDiLoCo`` is the low-communication counterpart: one fault-tolerant step is one
outer round of DiLoCo (``sync_every`` inner steps on the replica's own data, then one average of
the pseudo-gradients over the round's quorum and the outer optimizer's step). Nothing crosses
the network between synchronisations, not even a vote: a replica lost during a round is found
at its average, the round is discarded everywhere (every member's parameters and inner
optimizer go back to the round's start) and redone by the next quorum, whose members share the
lost replica's samples.
"""

from __future__ import annotations

import copy
import io
from typing import List

import numpy as np
import torch
import torch.distributed

import commlib
from commlib.errors import InvalidUsageError
from commlib.ft.sampling import shares
from ddp.distributed import DistributedDataParallel as OurDistributedDataParallel

__all__ = ["FaultTolerantDDP", "FaultTolerantDiLoCo", "fault_tolerant_torch_ddp", "fault_tolerant_ddp",
           "manager_comm_hook",
           "ManagerHookState", "TorchCodec",
           "flatten_gradients", "unflatten_gradients", "pseudo_gradient"]


class TorchCodec:
    """State objects (state dicts) to bytes and back, loading tensors and containers only."""

    @staticmethod
    def encode(obj) -> memoryview:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getbuffer()  # the bytes in place, writable: the catch-up sends from them

    @staticmethod
    def decode(data) -> dict:
        return torch.load(io.BytesIO(data), weights_only=True)


def register_model(manager, module: torch.nn.Module) -> str:
    """``module``'s state (parameters and buffers) goes to a joiner with the manager's catch-up,
    encoded by :class:`TorchCodec` unless the manager has a codec already. The name it is
    registered under: ``"model"`` for the first, then ``"model.1"``, ``"model.2"``, ... (several
    models on one manager, e.g. a generator and a discriminator: every replica runs the same
    program, so the n-th model has the same name on the source and the joiner)."""
    if manager.codec is None:
        manager.codec = TorchCodec()
    taken = sum(1 for name in manager.states if name == "model" or name.startswith("model."))
    name = "model" if not taken else f"model.{taken}"
    manager.register_state(name, module.state_dict, module.load_state_dict)
    return name


def flatten_gradients(params: List[torch.nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient (zeros where there is none) in one contiguous CPU tensor."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu()
                      for p in params])


def unflatten_gradients(params: List[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        count = p.numel()
        value = flat[offset:offset + count].view_as(p).to(p.device)
        if p.grad is None:
            p.grad = value.clone()
        else:
            p.grad.copy_(value)
        offset += count


class FaultTolerantDDP(torch.nn.Module):
    """``module`` trained by the replicas of ``manager``'s quorums (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, manager):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"FaultTolerantDDP: expected a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.manager = manager
        self.params = [p for p in module.parameters() if p.requires_grad]
        register_model(manager, module)
        manager.gradient_hooks.append(self.average_gradients)

    def forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled():
            self.manager.start_step()
        return self.module(*inputs, **kwargs)

    def average_gradients(self) -> None:
        """The gradients become the quorum's (sample-weighted) mean; on failure they are left to
        a step that will not be applied."""
        if not self.params:
            return
        flat = flatten_gradients(self.params)
        self.manager.average_over_replica(flat.numpy())  # a replica of several ranks: its own mean first
        self.manager.allreduce_average(flat.numpy(), self.manager.gradient_weight())
        unflatten_gradients(self.params, flat)


class ManagerHookState:
    """The state of :func:`manager_comm_hook`: ``manager``, and the buckets of the iteration so far.

    The buckets are averaged together, in the module's parameter order, once the last one is
    ready, not one by one: torch lays a DDP's buckets out anew after its first iteration
    (measured on the test MLP: the first iteration's bucket holds the parameters in the
    module's order, every later one in reverse), so a joiner in its first iteration and the
    members in a later one would sum different parameters' elements, bucket for bucket, with no
    error. In one order it is also the same sum as ``FaultTolerantDDP``'s, bit for bit.
    """

    def __init__(self, manager, module: torch.nn.Module):
        self.manager = manager
        self.order = {id(p): index for index, p in enumerate(module.parameters())}
        self.pending: List[tuple] = []


# No annotations: under ``from __future__ import annotations`` they are strings, which torch's
# check of a hook's signature refuses.
def manager_comm_hook(state, bucket):
    """A torch DDP communication hook (``ddp_model.register_comm_hook(ManagerHookState(manager,
    module), manager_comm_hook)``): each bucket's future completes once the iteration's last
    bucket is ready and every bucket became the quorum's sample-weighted mean. A failure is kept
    by the manager (the step is then discarded at ``opt.step()``), never raised inside backward."""
    buffer = bucket.buffer()
    if buffer.device.type != "cpu":
        raise InvalidUsageError(f"manager_comm_hook: the bucket is on {buffer.device}; the cross-replica "
                                f"average runs on CPU tensors only")
    if not state.manager.step_open:
        # Opening it here would join a quorum, and load a peer's parameters, in the middle of backward.
        raise InvalidUsageError("manager_comm_hook: no step is open: call zero_grad() on manager.optimizer(...) "
                                "(or manager.start_step()) before the forward pass")
    if bucket.index() == 0:
        state.pending = []  # what an interrupted backward left behind
    future: torch.futures.Future = torch.futures.Future()
    state.pending.append((buffer, list(bucket.parameters()), future))
    if not bucket.is_last():
        return future
    pending, state.pending = state.pending, []
    slices = []  # (module order, the parameter's gradient in its bucket)
    for held, params, _ in pending:
        offset = 0
        for param in params:
            slices.append((state.order[id(param)], held[offset:offset + param.numel()]))
            offset += param.numel()
    slices.sort(key=lambda item: item[0])
    flat = torch.cat([gradient for _, gradient in slices])
    state.manager.average_over_replica(flat.numpy())  # a replica of several ranks: its own mean first
    state.manager.allreduce_average(flat.numpy(), state.manager.gradient_weight())
    offset = 0
    for _, gradient in slices:
        gradient.copy_(flat[offset:offset + gradient.numel()])
        offset += gradient.numel()
    for held, _, waiting in pending:
        waiting.set_result(held)
    return future


def fault_tolerant_torch_ddp(module: torch.nn.Module, manager, process_group=None, **ddp_options):
    """torch's ``DistributedDataParallel`` over ``module``, averaged over ``manager``'s quorums by
    :func:`manager_comm_hook` (see the module docstring). ``process_group``: the replica's own
    torch group (its ranks, as many as the manager's local group); without one, the default
    group, made (one rank, gloo, an in-memory store) when torch.distributed is not initialized
    and the replica is one process. A replica of several ranks brings its own (under mpiexec,
    e.g. :func:`autograd_bridge.backend.init_process_group`). ``ddp_options`` go to torch's DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fault_tolerant_torch_ddp: expected a torch.nn.Module, got {type(module).__name__}")
    if process_group is None and not dist.is_initialized():
        if manager.local_size > 1:
            raise InvalidUsageError(f"fault_tolerant_torch_ddp: the replica has {manager.local_size} ranks and "
                                    f"torch.distributed is not initialized: pass process_group=, a torch group "
                                    f"of the replica's ranks, or initialize the default group over them (under "
                                    f"mpiexec: autograd_bridge.backend.init_process_group())")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return _hooked("fault_tolerant_torch_ddp", module, manager, dist.get_world_size(process_group),
                   lambda: DistributedDataParallel(module, process_group=process_group, **ddp_options))


def fault_tolerant_ddp(module: torch.nn.Module, manager, process_group=None, **ddp_options):
    """Our :class:`ddp.DistributedDataParallel` (its buckets, hooks, statistics and tracing) over
    ``module``, averaged over ``manager``'s quorums by :func:`manager_comm_hook`, as
    :func:`fault_tolerant_torch_ddp` does with torch's; the same average, bit for bit.
    ``process_group``: the replica's own commlib group (its ranks); without one, the manager's
    local group for a replica of several ranks, else the default group, made (one rank, over an
    in-memory store) when commlib is not initialized. ``ddp_options`` go to our DDP."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fault_tolerant_ddp: expected a torch.nn.Module, got {type(module).__name__}")
    if process_group is None:
        process_group = (manager.local_group if manager.local_group is not None
                         else commlib.world() if commlib.is_initialized()
                         else commlib.init(store=torch.distributed.HashStore(), rank=0, world_size=1))
    return _hooked("fault_tolerant_ddp", module, manager, process_group.size,
                   lambda: OurDistributedDataParallel(module, process_group=process_group, **ddp_options))


def _hooked(caller: str, module: torch.nn.Module, manager, group_size: int, make_ddp):
    """``make_ddp()`` (a DDP over ``module`` and the replica's group of ``group_size`` ranks), its
    buckets averaged over ``manager``'s quorums by :func:`manager_comm_hook`; ``module``
    registered for catch-up first."""
    if group_size != manager.local_size:
        # A DDP over other ranks than the replica's would average with ranks the manager does
        # not count (or leave some of the replica's out): refused before anything is sent.
        ranks = f"{group_size} rank" + ("" if group_size == 1 else "s")
        raise InvalidUsageError(f"{caller}: the DDP's group has {ranks} but the replica has {manager.local_size} "
                                f"(the manager's local_group): the DDP must run over the replica's own ranks")
    register_model(manager, module)
    model = make_ddp()
    model.register_comm_hook(ManagerHookState(manager, module), manager_comm_hook)
    return model


class FaultTolerantDiLoCo:
    """DiLoCo (Douillard et al., arXiv 2311.08105) over ``manager``'s quorums: one committed step
    of the manager is one outer round. ``manager.configure_data`` gets the samples of a round per
    replica (``sync_every`` inner batches)::

        manager.configure_data(len(data), batch_size * sync_every)
        diloco = FaultTolerantDiLoCo(net, manager, inner, outer, sync_every=50)
        while manager.steps < rounds:
            for batch in diloco.round():    # this replica's share of the round, in inner batches
                inner.zero_grad(); loss_of(net, batch).backward(); inner.step()
            diloco.sync()                   # True when the round committed

    At ``sync``, with ``theta`` the parameters at the round's start (the same on every member)
    and ``local`` this replica's after its inner steps: the members average ``theta - local``
    (weighted by their shares of the round's samples), the parameters go back to ``theta``, and
    the outer optimizer steps with that average as their gradient (every member lands on the
    same parameters). A discarded round puts the parameters and the inner optimizer back where
    the round started. The inner optimizer's state stays local, as in the paper; a joiner takes
    its source's with the parameters and the outer optimizer's state.

    A replica of several ranks (``Manager(local_group=...)``) trains data parallel inside, the
    loop unchanged: each inner batch is split over its ranks (in rank order, sizes differing by
    at most one), ``round()`` gives this rank its parts, and before each ``inner.step()`` (a step
    pre-hook on the inner optimizer) the gradients become the replica's mean over the whole
    inner batch (:meth:`commlib.ft.Manager.replica_mean`), so the replica's ranks keep equal
    parameters. A part may be empty (an inner batch smaller than the replica): skip its
    backward, but call ``inner.step()`` like the others (the average is collective).
    """

    def __init__(self, module: torch.nn.Module, manager, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, *, sync_every: int):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"FaultTolerantDiLoCo: expected a torch.nn.Module, got {type(module).__name__}")
        if int(sync_every) < 1:
            raise InvalidUsageError(f"FaultTolerantDiLoCo: sync_every must be >= 1, got {sync_every}")
        self.module, self.manager = module, manager
        self.inner, self.outer = inner_optimizer, outer_optimizer
        self.sync_every = int(sync_every)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._start: List[torch.Tensor] = []
        self._inner_start: dict = {}
        self._open = False
        self._parts: List[tuple] = []  # a replica of several ranks: (part, inner batch) per inner step
        self._inner_steps = 0
        if manager.local_size > 1:
            inner_optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._average_inner())
        register_model(manager, module)
        manager.register_state("inner", inner_optimizer.state_dict, inner_optimizer.load_state_dict)
        manager.register_state("outer", outer_optimizer.state_dict, outer_optimizer.load_state_dict)

    def round(self) -> List[np.ndarray]:
        """Open the round (joining a quorum and catching up first if needed): this replica's
        sample indices of it, split into ``sync_every`` inner batches (empty ones left out)."""
        self.manager.start_step()
        self._start = [p.detach().clone() for p in self.params]
        self._inner_start = copy.deepcopy(self.inner.state_dict())
        self._open = True
        indices = self.manager.batch_indices()
        chunks = [chunk for chunk in np.array_split(indices, self.sync_every) if chunk.size]
        if self.manager.local_size == 1:
            return chunks
        self._inner_steps = 0
        parts = [chunk[part.start:part.stop] for chunk in chunks
                 for part in [shares(len(chunk), self.manager.local_size)[self.manager.local_rank]]]
        self._parts = [(len(part), len(chunk)) for part, chunk in zip(parts, chunks)]
        return parts

    def _average_inner(self) -> None:
        """Before an inner step of a replica of several ranks: every gradient becomes the
        replica's mean over the inner batch (see the class docstring)."""
        if not self._open:
            raise InvalidUsageError(f"FaultTolerantDiLoCo: inner.step() outside a round on a replica of "
                                    f"{self.manager.local_size} ranks (its gradients are averaged over the replica "
                                    f"inside a round only: call round() first)")
        if self._inner_steps >= len(self._parts):
            raise InvalidUsageError(f"FaultTolerantDiLoCo: inner step {self._inner_steps + 1} of a round of "
                                    f"{len(self._parts)} inner batches on a replica of {self.manager.local_size} "
                                    f"ranks (one inner.step() per batch that round() gave, inside a round)")
        part, whole = self._parts[self._inner_steps]
        self._inner_steps += 1
        flat = flatten_gradients(self.params)
        self.manager.replica_mean(flat.numpy(), part, whole)
        unflatten_gradients(self.params, flat)

    def sync(self) -> bool:
        """End the round: average, vote, and apply the outer step or go back (see the class)."""
        if not self._open:
            raise InvalidUsageError("FaultTolerantDiLoCo.sync: no round is open (call round() first)")
        if self._inner_steps != len(self._parts):
            raise InvalidUsageError(f"FaultTolerantDiLoCo.sync: {self._inner_steps} inner steps of the round's "
                                    f"{len(self._parts)} on a replica of {self.manager.local_size} ranks (every "
                                    f"rank steps once per inner batch, also on an empty part)")
        delta = pseudo_gradient(self._start, self.params)
        self.manager.allreduce_average(delta.numpy(), self.manager.gradient_weight())
        committed = self.manager.should_commit()
        with torch.no_grad():
            for param, start in zip(self.params, self._start):
                param.copy_(start)
        if committed:
            for param in self.params:
                param.grad = None
            unflatten_gradients(self.params, delta)
            self.outer.step()
            for param in self.params:
                param.grad = None
        else:
            self.inner.load_state_dict(self._inner_start)
        self._start, self._open, self._parts, self._inner_steps = [], False, [], 0
        return committed


def pseudo_gradient(start: List[torch.Tensor], params: List[torch.nn.Parameter]) -> torch.Tensor:
    """``start - params`` of every parameter, in one contiguous CPU tensor."""
    return torch.cat([(first - param.detach()).reshape(-1).cpu() for first, param in zip(start, params)])
