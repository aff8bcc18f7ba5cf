"""commlib as a ``torch.distributed`` backend named ``"commlib"``.

    mpiexec -n 2 python train.py      # with, in train.py:
        import autograd_bridge; autograd_bridge.init_process_group()
        model = torch.nn.parallel.DistributedDataParallel(net)   # torch's own DDP, on commlib

:class:`CommlibProcessGroup` is a ``torch.distributed.ProcessGroup`` written in Python over a
``commlib.ProcessGroup`` (torch calls a Python subclass's methods both from Python and, through
its pybind trampoline, from C++: DDP's reducer and ``_broadcast_coalesced``). It serves what
torch's DDP and the public collectives call: allreduce (+coalesced), broadcast, reduce,
allgather (list, into-tensor, coalesced), reduce_scatter (list, tensor), barrier, and gather /
scatter (commlib's rooted ones; the *_object collectives ride on these); and, in
:mod:`.backend_exchange`, send / recv / recv_anysource (so ``batch_isend_irecv`` too), alltoall
(list and single, with and without split sizes) and monitored_barrier. Ops: SUM, AVG (floats),
MIN, MAX, PRODUCT; BAND/BOR/BXOR on
integer and bool CPU tensors (an allgather and a local reduce). Dtypes: every int and float
type incl. float16/bfloat16, bool (as uint8), complex (as pairs of reals); non-contiguous
tensors go through a contiguous copy that is copied back.

Creating a group, with the check that torch's ranks are MPI's, and ``init_process_group``
(a TCPStore found over MPI) are in :mod:`.rendezvous`.

Ordering: all collectives of a group run in one order, the same on every rank, whatever thread
issues them (the caller's thread, DDP's autograd thread, a comm hook's callback): commlib's
executor numbers them when they start, runs done-callbacks (which complete the torch futures
here) on the group's communication thread right after their collective, and runs a collective
issued from such a callback at once. So PowerSGD with several buckets in flight gives every rank
the same order (see :mod:`commlib.executor` for the rule, :mod:`.backend_work` for the futures).

Completion: a sync call returns an already completed Work; an async one a Work over a torch
Future completed by an ordered done-callback of the collective.
Tensors reach commlib as array views or copied-back copies (:mod:`.staging`), torch's reduce
ops as commlib's or as bitwise ufuncs (:mod:`.reduce_ops`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions

import commlib
from commlib import InvalidUsageError

from .backend_exchange import ExchangeMethods
from .backend_work import Completer
from .reduce_ops import PLAIN_OPS, RED, SUM_VALUE, lookup_op, op_value_of
from .staging import NUMPY_DTYPES, Staged, chain, copy_back_all, single

__all__ = ["CommlibProcessGroup", "BACKEND_NAME", "commlib_group_of", "register"]

BACKEND_NAME = "commlib"
_CACHE_BYTES = 64 << 10


class CommlibProcessGroup(ExchangeMethods, dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` whose collectives run on a ``commlib.ProcessGroup``."""

    def __init__(self, group: "commlib.ProcessGroup"):
        super().__init__(group.rank, group.size)  # type: ignore[call-arg]  # bound, not in torch's stub
        self.commlib_group = group
        self._completer = Completer()
        self._done = self._completer.done
        # The hot path's cached numpy view (holds at most one small tensor alive).
        self._last: Tuple[Optional[torch.Tensor], int, Optional[torch.dtype], np.ndarray] = (None, 0, None, np.empty(0))

    def getBackendName(self) -> str:
        return BACKEND_NAME

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
                and not opts.asyncOp):
            tensor: torch.Tensor = tensors[0]
            op = PLAIN_OPS[int(opts.reduceOp.op)]  # type: ignore[attr-defined]  # bound, not in torch's stub
            # Tensor.numpy() and the checks before it cost ~2 us: reuse the view of the last
            # tensor while it is the same object over the same memory (same pointer, dtype and
            # size, still contiguous: the same flat buffer to an allreduce).
            last = self._last  # one tuple, replaced whole: safe if two threads race here
            if (tensor is last[0] and op is not None and tensor.data_ptr() == last[1]
                    and tensor.dtype is last[2] and tensor.is_contiguous() and tensor.numel() == last[3].size):
                self.commlib_group.allreduce(last[3], op)
                return self._done
            if (op is not None and tensor.dtype in NUMPY_DTYPES and not tensor.requires_grad
                    and not tensor.is_cuda and tensor.is_contiguous()):
                array = tensor.numpy()
                if array.nbytes <= _CACHE_BYTES:
                    self._last = (tensor, tensor.data_ptr(), tensor.dtype, array)
                self.commlib_group.allreduce(array, op)
                return self._done
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensor = single(tensors, "allreduce")
        if opts is None or isinstance(opts, (dist.ReduceOp, RED)):
            # Called as pg.allreduce(tensor[, op]) (DDP's unused-parameter map does this).
            op_value = SUM_VALUE if opts is None else op_value_of(opts)
            opts = _ASYNC
        else:
            op_value = op_value_of(opts.reduceOp)
        return self._allreduce_staged([Staged(tensor, "allreduce tensor")], op_value, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        staged = [Staged(t, "allreduce_coalesced tensor") for t in tensors]
        op_value = SUM_VALUE if opts is None else op_value_of(opts.reduceOp)
        return self._allreduce_staged(staged, op_value, opts)

    def _allreduce_staged(self, staged, op_value, opts):
        op, bitwise = lookup_op(op_value, staged)
        group = self.commlib_group
        finishers = []
        if bitwise is None:
            def issue(async_op):
                work = None
                for s in staged:
                    work = group.allreduce(s.array, op, async_op=async_op)
                return work  # issue order is completion order: the last one done means all done
        else:
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
        return self._completer.complete(opts or _ASYNC, issue, [s.tensor for s in staged],
                            chain(finishers), staged[0].cuda_device if staged else None)

    # -- one-to-all and all-to-one -------------------------------------------------------------
    def broadcast(self, tensors, opts=None):  # type: ignore[override]  # torch calls (tensors, opts)
        tensor = single(tensors, "broadcast")
        root = 0 if opts is None else opts.rootRank
        staged = Staged(tensor, "broadcast tensor")
        group = self.commlib_group
        return self._completer.complete(opts or _ASYNC,
                            lambda async_op: group.broadcast(staged.array, root, async_op=async_op),
                            [tensor], copy_back_all([staged]), staged.cuda_device)

    def reduce(self, tensors, opts=None):  # type: ignore[override]  # torch calls (tensors, opts)
        tensor = single(tensors, "reduce")
        staged = Staged(tensor, "reduce tensor")
        op_value = SUM_VALUE if opts is None else op_value_of(opts.reduceOp)
        op, bitwise = lookup_op(op_value, [staged])
        if bitwise is not None:
            raise InvalidUsageError(f"commlib backend: reduce supports SUM, AVG, MIN, MAX, PRODUCT; "
                                    f"got {RED(op_value).name}")
        root = 0 if opts is None else opts.rootRank
        group = self.commlib_group
        return self._completer.complete(opts or _ASYNC,
                            lambda async_op: group.reduce(staged.array, root, op, async_op=async_op),
                            [tensor], copy_back_all([staged]), staged.cuda_device)

    def barrier(self, opts=None):
        group = self.commlib_group
        return self._completer.complete(opts or _ASYNC, lambda async_op: group.barrier(async_op=async_op), [])

    # -- gathers and scatters ------------------------------------------------------------------
    def allgather(self, output_lists, input_tensors, opts=None):
        outputs = single(output_lists, "allgather") if not isinstance(output_lists[0], torch.Tensor) else output_lists
        inp = Staged(single(input_tensors, "allgather"), "allgather input")
        self._check_parts(outputs, inp.tensor, "allgather", "output list")
        flat = torch.empty((self.size(),) + tuple(inp.tensor.shape), dtype=inp.tensor.dtype,
                           device=inp.tensor.device)
        flat_staged = Staged(flat, "allgather staging")
        group = self.commlib_group

        def finish():
            for index, out in enumerate(outputs):
                out.copy_(flat[index])

        return self._completer.complete(opts or _ASYNC,
                            lambda async_op: group.allgather(flat_staged.array, inp.array, async_op=async_op),
                            [outputs], finish, inp.cuda_device)

    def all_gather_single(self, output, input, opts=None):
        out, inp = Staged(output, "all_gather output"), Staged(input, "all_gather input")
        group = self.commlib_group
        return self._completer.complete(opts or _ASYNC,
                            lambda async_op: group.allgather(out.array, inp.array, async_op=async_op),
                            [output], copy_back_all([out]), out.cuda_device)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        works = [self.allgather(outs, [inp], opts) for outs, inp in zip(output_lists, input_tensors)]
        return works[-1] if works else self._done

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(out, inp, opts) for out, inp in zip(outputs, inputs)]
        return works[-1] if works else self._done

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):  # type: ignore[override]  # torch calls (tensors, opts)
        output = single(outputs, "reduce_scatter")
        parts = single(input_lists, "reduce_scatter") if not isinstance(input_lists[0], torch.Tensor) else input_lists
        self._check_parts(parts, output, "reduce_scatter", "input list")
        return self.reduce_scatter_single(output, torch.stack([p.detach() for p in parts]), opts)

    def reduce_scatter_single(self, output, input, opts=None):
        op_value = SUM_VALUE if opts is None else op_value_of(opts.reduceOp)
        out, inp = Staged(output, "reduce_scatter output"), Staged(input, "reduce_scatter input")
        op, bitwise = lookup_op(op_value, [out])
        if bitwise is not None:
            raise InvalidUsageError(f"commlib backend: reduce_scatter supports SUM, AVG, MIN, MAX, PRODUCT; "
                                    f"got {RED(op_value).name}")
        group = self.commlib_group
        return self._completer.complete(opts or _ASYNC,
                            lambda async_op: group.reduce_scatter(out.array, inp.array, op, async_op=async_op),
                            [output], copy_back_all([out]), out.cuda_device)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(out, inp, opts) for out, inp in zip(outputs, inputs)]
        return works[-1] if works else self._done

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # gather and scatter: commlib's own rooted collectives, so each rank moves its block once
    # (torch hands a list of tensors; commlib takes one flat rank-major buffer on the root).
    def gather(self, output_lists, input_tensors, opts=None):  # type: ignore[override]  # torch calls (tensors, opts)
        root = 0 if opts is None else opts.rootRank
        inp = Staged(single(input_tensors, "gather"), "gather input")  # non-contiguous: a copy, never copied back
        outputs = output_lists[0] if output_lists else []
        flat_staged = None
        if self.rank() == root:
            self._check_parts(outputs, inp.tensor, "gather", "gather_list")
            flat_staged = Staged(torch.empty((self.size(),) + tuple(inp.tensor.shape), dtype=inp.tensor.dtype,
                                             device=inp.tensor.device), "gather staging")
        flat_out = None if flat_staged is None else flat_staged.array
        group = self.commlib_group

        def finish():
            if flat_staged is not None:
                for index, out in enumerate(outputs):
                    out.copy_(flat_staged.tensor[index])

        # The future's value is what gloo's holds: the gather list on the root, [] elsewhere.
        return self._completer.complete(opts or _ASYNC,
                            lambda async_op: group.gather(flat_out, inp.array, root, async_op=async_op),
                            list(outputs), finish, inp.cuda_device)

    def scatter(self, output_tensors, input_lists, opts=None):  # type: ignore[override]  # torch calls (tensors, opts)
        root = 0 if opts is None else opts.rootRank
        out = Staged(single(output_tensors, "scatter"), "scatter output")
        flat_in = None
        if self.rank() == root:
            parts = input_lists[0] if input_lists else []
            self._check_parts(parts, out.tensor, "scatter", "scatter_list")
            flat_in = Staged(torch.stack([p.detach() for p in parts]), "scatter staging").array
        group = self.commlib_group
        return self._completer.complete(opts or _ASYNC,
                            lambda async_op: group.scatter(out.array, flat_in, root, async_op=async_op),
                            [out.tensor], copy_back_all([out]), out.cuda_device)

    def _check_parts(self, parts, like: torch.Tensor, collective: str, what: str) -> None:
        if len(parts) != self.size():
            raise InvalidUsageError(f"commlib backend: {collective}: {what} has {len(parts)} tensors; "
                                    f"expected world size {self.size()}")
        for index, part in enumerate(parts):
            if part.shape != like.shape or part.dtype != like.dtype:
                raise InvalidUsageError(
                    f"commlib backend: {collective}: {what}[{index}] is {part.dtype} {tuple(part.shape)}; "
                    f"expected {like.dtype} {tuple(like.shape)} like this rank's tensor"
                )

    def shutdown(self) -> None:
        """Nothing of its own to stop: the commlib group outlives its torch wrappers."""


class _AsyncOptions:
    """Stands in for torch's options when a caller passes none: torch's default is asyncOp=True."""

    asyncOp = True


_ASYNC = _AsyncOptions()


def commlib_group_of(group=None) -> "commlib.ProcessGroup":
    """The commlib group under a torch group created with the "commlib" backend (default: world)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(group, CommlibProcessGroup):
        raise InvalidUsageError(f"expected a process group of the {BACKEND_NAME!r} backend, got {group!r}")
    return group.commlib_group


def register() -> None:
    """Register the backend name (done on ``import autograd_bridge``); idempotent."""
    if hasattr(dist.Backend, BACKEND_NAME.upper()):
        return
    from .rendezvous import create_process_group  # rendezvous imports this module

    # torch 2.13 iterates ``devices``: a plain string would register one device per character.
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                  devices=["cpu", "cuda"])
