"""commlib as a ``torch.distributed`` backend named ``"commlib"``.

    mpiexec -n 2 python train.py      # with, in train.py:
        import autograd_bridge; autograd_bridge.init_process_group()
        model = torch.nn.parallel.DistributedDataParallel(net)   # torch's own DDP, on commlib

:class:`CommlibProcessGroup` is a ``torch.distributed.ProcessGroup`` written in Python over a
``commlib.ProcessGroup`` (torch calls a Python subclass's methods both from Python and, through
its pybind trampoline, from C++: DDP's reducer, ``_broadcast_coalesced``, and the functional
collectives of DTensor, which find the group by its name). It serves torch's whole stack on CPU
tensors: DDP, DeviceMesh, DTensor, FSDP2, distributed checkpoint, ZeroRedundancyOptimizer.
Here: allreduce (dense and sparse COO, :mod:`.sparse`; + coalesced), broadcast, reduce,
barrier, and the group's name, description and ``split_group``; in :mod:`.gathers` the
allgathers, reduce-scatters, their coalesced forms, gather and scatter; in :mod:`.exchange`
send / recv / recv_anysource (so ``batch_isend_irecv`` too), alltoall (list and single, with
and without split sizes) and monitored_barrier. Ops and dtypes: :mod:`.reduce_ops`; what the
backend refuses (with an error naming collective, op, dtype and device, before anything is
sent): :mod:`.validation`. Non-contiguous tensors go through a contiguous copy that is copied
back (:mod:`.staging`).

Names: torch keeps a group's name and description in its per-device backends, which a Python
group has none of, so this group keeps them itself (``getGroupName`` / ``setGroupName`` and the
description's pair are what torch's trampoline calls): ``group.group_name`` and
``group.group_desc`` then work as on gloo, and with them DeviceMesh and everything that finds a
group through ``_resolve_process_group``.

Creating a group, with the check that torch's ranks are MPI's, and ``init_process_group``
(a TCPStore found over MPI) are in :mod:`.rendezvous` and :mod:`.subgroups`.

Ordering: all collectives of a group run in one order, the same on every rank, whatever thread
issues them (the caller's thread, DDP's autograd thread, a comm hook's callback): commlib's
executor numbers them when they start, runs done-callbacks (which complete the torch futures
here) on the group's communication thread right after their collective, and runs a collective
issued from such a callback at once. So PowerSGD with several buckets in flight gives every rank
the same order (see :mod:`commlib.execution.executor` for the rule, :mod:`.work` for the futures).

Completion: a sync call returns an already completed Work; an async one a Work over a torch
Future completed by an ordered done-callback of the collective.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions

import commlib
from commlib import InvalidUsageError

from autograd_bridge.backend.exchange import ExchangeMethods
from autograd_bridge.backend.gathers import PACK_BYTES, GatherMethods
from autograd_bridge.backend.profiling import profiled, profiler_running, tensors_of
from autograd_bridge.backend.reduce_ops import PLAIN_OPS, RED, op_name, op_value_of, plan_reduction
from autograd_bridge.backend.sparse import SparseAllreduce
from autograd_bridge.backend.staging import NUMPY_DTYPES, Staged, chain, copy_back_all, single
from autograd_bridge.backend.subgroups import split, timeout_for
from autograd_bridge.backend.validation import check_served
from autograd_bridge.backend.work import Completer

__all__ = ["CommlibProcessGroup", "BACKEND_NAME", "commlib_group_of"]

BACKEND_NAME = "commlib"
_CACHE_BYTES = 64 << 10


# (mypy: the mixins' gather/scatter/reduce_scatter take (tensors, opts), as torch calls them,
# where torch's stub declares other signatures.)
class CommlibProcessGroup(GatherMethods, ExchangeMethods, dist.ProcessGroup):  # type: ignore[misc]
    """A ``torch.distributed.ProcessGroup`` whose collectives run on a ``commlib.ProcessGroup``."""

    def __init__(self, group: "commlib.ProcessGroup"):
        super().__init__(group.rank, group.size)  # type: ignore[call-arg]  # bound, not in torch's stub
        self.commlib_group = group
        self._completer = Completer(group)
        self._done = self._completer.done
        self._group_name = ""
        self._group_desc = ""
        # The hot path's cached numpy view (holds at most one small tensor alive).
        self._last: Tuple[Optional[torch.Tensor], int, Optional[torch.dtype], np.ndarray] = (None, 0, None, np.empty(0))

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch keeps a group's name and description in its device backends; a Python group has
    # none, so it keeps them itself (torch's pybind trampoline calls these four).
    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def name(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        group = self.commlib_group
        return f"<CommlibProcessGroup rank {group.rank} of {group.size} over {group!r}>"

    # -- allreduce -----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):  # type: ignore[override]  # torch calls (tensors, opts)
        # The hot path: dist.all_reduce(t) of a plain CPU tensor. A few microseconds of Python
        # here are a third of a small allreduce, so: no staging, no Future, no extra calls.
        if (opts.__class__ is AllreduceOptions and tensors.__class__ is list and len(tensors) == 1
                and not opts.asyncOp and not profiler_running()):
            tensor: torch.Tensor = tensors[0]
            op = PLAIN_OPS[int(opts.reduceOp.op)]  # type: ignore[attr-defined]  # bound, not in torch's stub
            # Tensor.numpy() and the checks before it cost ~2 us: reuse the view of the last
            # tensor while it is the same object over the same memory (same pointer, dtype and
            # size, still contiguous: the same flat buffer to an allreduce).
            last = self._last  # one tuple, replaced whole: safe if two threads race here
            if (tensor is last[0] and op is not None and tensor.data_ptr() == last[1]
                    and tensor.dtype is last[2] and tensor.is_contiguous() and tensor.numel() == last[3].size):
                try:
                    self.commlib_group.allreduce(last[3], op)
                    return self._done
                except InvalidUsageError:  # refused before sending: say it in torch's terms below
                    pass
            # (is_cpu: not meta; is_contiguous: False for sparse tensors, which go below.)
            if (op is not None and tensor.dtype in NUMPY_DTYPES and not tensor.requires_grad
                    and tensor.is_cpu and tensor.is_contiguous()):
                array = tensor.numpy()
                try:
                    self.commlib_group.allreduce(array, op)
                except InvalidUsageError:  # refused before sending (AVG of integers): as above
                    pass
                else:
                    if array.nbytes <= _CACHE_BYTES:
                        self._last = (tensor, tensor.data_ptr(), tensor.dtype, array)
                    return self._done
        return self._allreduce(tensors, opts)

    @profiled("all_reduce", lambda tensors, opts=None: tensors_of(tensors))
    def _allreduce(self, tensors, opts):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensor = single(tensors, "allreduce")
        if opts is None or isinstance(opts, (dist.ReduceOp, RED)):
            # Called as pg.allreduce(tensor[, op]) (DDP's unused-parameter map does this).
            torch_op, opts = opts, _ASYNC
        else:
            torch_op = opts.reduceOp
        if tensor.layout is torch.sparse_coo:
            check_served("all_reduce", tensor, sparse_ok=True)
            call = SparseAllreduce(self.commlib_group, tensor, torch_op)
            return self._completer.complete(opts, call.issue, [tensor], call.finish, nbytes=call.gathered.nbytes)
        return self._allreduce_staged("all_reduce", [tensor], torch_op, opts)

    @profiled("all_reduce_coalesced", lambda tensors, opts=None: tensors_of(tensors))
    def allreduce_coalesced(self, tensors, opts=None):
        op = None if opts is None else opts.reduceOp
        return self._allreduce_staged("all_reduce_coalesced", list(tensors), op, opts)

    def _allreduce_staged(self, collective: str, tensors, op, opts):
        for tensor in tensors:
            check_served(collective, tensor)
        plan = plan_reduction(collective, op, tensors)
        if plan.premul is not None:  # the tensors are the outputs too: scale them in place
            for tensor in tensors:
                tensor.mul_(plan.premul)
        staged = [Staged(t, f"{collective} tensor", reduces=plan.bitwise is None) for t in tensors]
        group = self.commlib_group
        finishers = []
        commlib_op = plan.op
        if plan.bitwise is None and _packable_arrays(staged):
            # Several small tensors of one dtype (allreduce_coalesced): one collective over a packed copy.
            packed = np.concatenate([s.array.reshape(-1) for s in staged])

            def issue(async_op):
                return group.allreduce(packed, commlib_op, async_op=async_op)

            def unpack():
                offset = 0
                for s in staged:
                    s.array.reshape(-1)[...] = packed[offset:offset + s.array.size]
                    offset += s.array.size

            finishers.append(unpack)
        elif plan.bitwise is None:
            def issue(async_op):
                work = None
                for s in staged:
                    work = group.allreduce(s.array, commlib_op, async_op=async_op)
                return work  # issue order is completion order: the last one done means all done
        else:
            bitwise = plan.bitwise
            gathered = [np.empty((group.size,) + s.array.shape, s.array.dtype) for s in staged]
            sources = [s.array.copy() for s in staged]

            def issue(async_op):
                work = None
                for out, inp in zip(gathered, sources):
                    work = group.allgather(out, inp, async_op=async_op)
                return work

            def reduce_gathered():
                for out, s in zip(gathered, staged):
                    bitwise.reduce(out, axis=0, out=s.array)

            finishers.append(reduce_gathered)
        copy_back = copy_back_all(staged)
        if copy_back is not None:
            finishers.append(copy_back)
        return self._completer.complete(opts, issue, [s.tensor for s in staged], chain(finishers),
                                        staged[0].cuda_device if staged else None,
                                        nbytes=sum(s.array.nbytes for s in staged))

    # -- one-to-all and all-to-one -------------------------------------------------------------
    @profiled("broadcast", lambda tensors, opts=None: tensors_of(tensors))
    def broadcast(self, tensors, opts=None):  # type: ignore[override]  # torch calls (tensors, opts)
        tensor = single(tensors, "broadcast")
        check_served("broadcast", tensor)
        root = 0 if opts is None else opts.rootRank
        staged = Staged(tensor, "broadcast tensor")
        group = self.commlib_group
        return self._completer.complete(opts, lambda async_op: group.broadcast(staged.array, root, async_op=async_op),
                                        [tensor], copy_back_all([staged]), staged.cuda_device,
                                        nbytes=staged.array.nbytes)

    @profiled("reduce", lambda tensors, opts=None: tensors_of(tensors))
    def reduce(self, tensors, opts=None):  # type: ignore[override]  # torch calls (tensors, opts)
        tensor = single(tensors, "reduce")
        check_served("reduce", tensor)
        op = None if opts is None else opts.reduceOp
        plan = plan_reduction("reduce", op, [tensor])
        if plan.bitwise is not None:
            raise InvalidUsageError(f"commlib backend: reduce with {op_name(op_value_of(op))} on a {tensor.dtype} "
                                    f"tensor on {tensor.device} is not supported; expected SUM, AVG, MIN, MAX, "
                                    f"PRODUCT or PREMUL_SUM (all_reduce has the bitwise ops)")
        root = 0 if opts is None else opts.rootRank
        finish = None
        if plan.premul is None:
            staged = Staged(tensor, "reduce tensor", reduces=True)
            finish = copy_back_all([staged])
        else:  # scaled in a copy: the ranks other than the root keep their tensor as it was
            scaled = tensor * plan.premul
            staged = Staged(scaled, "reduce tensor", reduces=True)
            if self.rank() == root:
                finish = chain([f for f in (copy_back_all([staged]), functools.partial(tensor.copy_, scaled)) if f])
        group, commlib_op = self.commlib_group, plan.op
        return self._completer.complete(
            opts, lambda async_op: group.reduce(staged.array, root, commlib_op, async_op=async_op),
            [tensor], finish, staged.cuda_device, nbytes=staged.array.nbytes)

    @profiled("barrier", lambda opts=None: [])
    def barrier(self, opts=None):
        group = self.commlib_group
        return self._completer.complete(opts, lambda async_op: group.barrier(async_op=async_op), [], nbytes=0)

    # -- groups --------------------------------------------------------------------------------
    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """``ProcessGroup.split_group`` (what ``dist.split_group`` calls): collective over this group;
        the group of ``ranks`` (ranks of this group) named ``group_name``, or None on a rank not in
        ``ranks`` (see :func:`.subgroups.split`). torch's own splits through the device backends,
        which a Python group has none of."""
        seconds = timeout.total_seconds() if timeout is not None else None
        group = split(self.commlib_group, ranks, timeout_for(seconds))
        if group is None:
            return None
        child = CommlibProcessGroup(group)
        child.setGroupName(group_name or "")
        child.setGroupDesc(group_desc or f"{self._group_desc}:split")
        return child

    splitGroup = split_group  # the name torch's trampoline looks for, where it has one

    def shutdown(self) -> None:
        """Nothing of its own to stop: the commlib group outlives its torch wrappers."""


class _AsyncOptions:
    """Stands in for torch's options when a caller passes none: torch's default is asyncOp=True."""

    asyncOp = True


_ASYNC = _AsyncOptions()


def _packable_arrays(staged) -> bool:
    if len(staged) < 2 or any(s.cuda_device is not None for s in staged):
        return False
    dtype = staged[0].array.dtype
    return all(s.array.dtype == dtype for s in staged) and sum(s.array.nbytes for s in staged) <= PACK_BYTES


def commlib_group_of(group=None) -> "commlib.ProcessGroup":
    """The commlib group under a torch group created with the "commlib" backend (default: world)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(group, CommlibProcessGroup):
        raise InvalidUsageError(f"expected a process group of the {BACKEND_NAME!r} backend, got {group!r}")
    return group.commlib_group

