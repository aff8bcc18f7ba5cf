"""commlib as a ``torch.distributed`` backend named ``"commlib"``.

    mpiexec -n 2 python train.py      # with, in train.py:
        import autograd_bridge; autograd_bridge.init_process_group()
        model = torch.nn.parallel.DistributedDataParallel(net)   # torch's own DDP, on commlib

:class:`CommlibProcessGroup` is a ``torch.distributed.ProcessGroup`` written in Python over a
``commlib.ProcessGroup`` (torch calls a Python subclass's methods both from Python and, through
its pybind trampoline, from C++: DDP's reducer and ``_broadcast_coalesced``). It serves what
torch's DDP and the public collectives call: allreduce (+coalesced), broadcast, reduce,
allgather (list, into-tensor, coalesced), reduce_scatter (list, tensor), barrier, and gather /
scatter (over allgather / broadcast, so the *_object collectives work). Not served: send/recv,
alltoall, monitored_barrier. Ops: SUM, AVG (floats), MIN, MAX, PRODUCT; BAND/BOR/BXOR on
integer and bool CPU tensors (an allgather and a local reduce). Dtypes: every int and float
type incl. float16/bfloat16, bool (as uint8), complex (as pairs of reals); non-contiguous
tensors go through a contiguous copy that is copied back.

The backend needs MPI ranks: launch under ``mpiexec``. ``dist.init_process_group("commlib",
rank=, world_size=, store=)`` works too, but rank and world_size must equal MPI's (checked).
A group's timeout is the shorter of torch's ``timeout=`` and commlib's (``COMMLIB_TIMEOUT``,
300 s); the default group reuses ``commlib.init()``'s world group if it exists already.

Ordering: all collectives of a group get one global issue order (commlib's executor), whatever
thread issues them (the caller's thread, DDP's autograd thread, a comm hook's callback). The
order is identical on every rank only if every rank *issues* in the same order. torch's DDP
launches its buckets in a fixed order; a hook that issues more collectives from a completion
callback while the next bucket is being launched (PowerSGD with several buckets in flight) races
with the autograd thread (gloo assigns its tags at issue time too, so it should share the
problem; not verified); with one bucket in flight it is deterministic (tested).

Completion: a sync call (``opts.asyncOp`` False, as ``dist.all_reduce(t)`` passes) runs through
commlib's synchronous path (inline when the line is empty: the small-allreduce fast path) and
returns an already completed Work, so the Future machinery costs nothing on the hot path. An
async call returns a Work over a ``torch.futures.Future`` completed by this group's *completion
thread*, not by commlib's communication thread: torch runs a future's callbacks on the thread
that completes it, and a comm hook's callback that issues a collective and waits for it
(PowerSGD does) would otherwise block the very thread that has to run that collective. Futures
of collectives issued *from* the completion thread are completed on the communication thread.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions
from torch.futures import Future

import commlib
from commlib import InvalidUsageError, ReduceOp

from .tensors import to_array

__all__ = ["CommlibProcessGroup", "init_process_group", "BACKEND_NAME", "commlib_group_of"]

BACKEND_NAME = "commlib"

_RED = dist.ReduceOp.RedOpType
# torch op -> (commlib op, None) or (None, numpy ufunc for a bitwise allreduce via allgather)
_OPS = {
    int(_RED.SUM.value): (ReduceOp.SUM, None),
    int(_RED.AVG.value): (ReduceOp.AVG, None),
    int(_RED.MIN.value): (ReduceOp.MIN, None),
    int(_RED.MAX.value): (ReduceOp.MAX, None),
    int(_RED.PRODUCT.value): (ReduceOp.PROD, None),
    int(_RED.BAND.value): (None, np.bitwise_and),
    int(_RED.BOR.value): (None, np.bitwise_or),
    int(_RED.BXOR.value): (None, np.bitwise_xor),
}
_SUM_VALUE = int(_RED.SUM.value)
# Indexed by int(RedOpType): a tuple index is cheaper than hashing a pybind enum.
_PLAIN_OPS = tuple(_OPS.get(value, (None, None))[0] for value in range(64))
_CACHE_BYTES = 64 << 10
_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                           torch.int32, torch.int64, torch.uint8})


def _op_value(op) -> int:
    """int of a torch ReduceOp / RedOpType (opts.reduceOp is a ReduceOp wrapping a RedOpType)."""
    return int(op.op) if isinstance(op, dist.ReduceOp) else int(op)


class _FutureWork(dist._Work):
    """A torch Work over a torch Future (completed by the backend).

    Not ``_create_work_from_future``: its ``wait()`` returns True even when the future holds an
    error, and an async collective that failed would look like a success.
    """

    def __init__(self, future: Future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.wait()  # re-raises the collective's error
        return True

    def get_future(self) -> Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - the answer is "no"
            return False
        return True

    def result(self):
        return self._future.wait()

    def synchronize(self) -> None:
        self.wait()


def _done_work():
    future = Future()
    future.set_result([])
    return _FutureWork(future)


class _Completer:
    """One daemon thread that completes torch futures (and so runs their callbacks)."""

    def __init__(self, name: str):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        self._queue.put(item)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _deliver(*item)

    def close(self) -> None:
        self._queue.put(None)


def _deliver(future: Future, work, finish, result) -> None:
    error = work.exception()
    if error is None and work.__class__ is not commlib.Work:
        # A GPU work completes when enqueued; a torch future has no stream semantics here, so
        # its waiters must see the data: block this (completion) thread until the GPU is done.
        try:
            work.synchronize()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            error = exc
    if error is None and finish is not None:
        try:
            finish()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            error = exc
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class _TorchStreamRef:
    """The ``__cuda_stream__`` protocol over a torch stream (what CuPy's ``from_external`` takes)."""

    def __init__(self, stream):
        self._stream = stream

    def __cuda_stream__(self):
        return (0, self._stream.cuda_stream)


@contextlib.contextmanager
def _on_torch_stream(device: torch.device):
    """CuPy's current device and stream := torch's, for this thread (untested: no GPU here)."""
    import cupy

    stream = torch.cuda.current_stream(device)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    cupy_stream = (from_external(_TorchStreamRef(stream)) if from_external is not None
                   else cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index))
    with cupy.cuda.Device(stream.device.index), cupy_stream:
        yield


class _Staged:
    """An array view of a tensor; for a non-contiguous or bool tensor, a copy that is copied back."""

    __slots__ = ("tensor", "array", "copy", "cuda_device")

    def __init__(self, tensor: torch.Tensor, what: str):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"commlib backend: {what} must be a torch.Tensor, got {type(tensor).__name__}")
        self.tensor = tensor
        self.cuda_device = tensor.device if tensor.is_cuda else None
        self.copy = None if tensor.is_contiguous() else tensor.contiguous()
        source = tensor if self.copy is None else self.copy
        if source.dtype == torch.bool:  # numpy's bool is no MPI type; same bytes as uint8
            source = source.view(torch.uint8)
        elif source.is_complex():
            source = torch.view_as_real(source)
        self.array = to_array(source)

    def copy_back(self) -> None:
        if self.copy is not None:
            self.tensor.copy_(self.copy)


def _copy_back_all(staged):
    needing = [s for s in staged if s.copy is not None]
    if not needing:
        return None

    def finish():
        for s in needing:
            s.copy_back()

    return finish


def _single(tensors, collective: str):
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise InvalidUsageError(
            f"commlib backend: {collective} takes exactly one tensor per call (one device per "
            f"process), got {len(tensors)}"
        )
    return tensors[0]


class CommlibProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` whose collectives run on a ``commlib.ProcessGroup``."""

    def __init__(self, group: "commlib.ProcessGroup"):
        super().__init__(group.rank, group.size)
        self.commlib_group = group
        self._completer = _Completer(f"commlib-torch-completion-{group.name}")
        self._done = _done_work()
        # The hot path's cached numpy view (holds at most one small tensor alive).
        self._last = (None, 0, None, np.empty(0))

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"<CommlibProcessGroup rank {self.commlib_group.rank} of {self.commlib_group.size} over {self.commlib_group!r}>"

    # -- completion ----------------------------------------------------------------------------
    def _finish(self, opts, issue, result, finish=None, device=None):
        """Run ``issue(async_op)`` (a commlib call); return a torch Work completed after it.

        ``device``: the CUDA device of the tensors (None on CPU); the call is then issued with
        torch's current stream made CuPy's current stream, which commlib's GPU backend orders
        its comm stream after (and, for a sync call, makes wait for the result).
        """
        if device is not None:
            with _on_torch_stream(device):
                return self._finish(opts, issue, result, finish)
        if opts is not None and not opts.asyncOp:
            issue(False)
            if finish is not None:
                finish()
            return self._done
        future = Future()
        work = issue(True)
        if threading.current_thread() is self._completer.thread:
            work.add_done_callback(lambda w: _deliver(future, w, finish, result))
        else:
            put = self._completer.put
            work.add_done_callback(lambda w: put((future, w, finish, result)))
        return _FutureWork(future)

    # -- allreduce -----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        # The hot path: dist.all_reduce(t) of a plain CPU tensor. A few microseconds of Python
        # here are a third of a small allreduce, so: no staging, no Future, no extra calls.
        if (opts.__class__ is AllreduceOptions and tensors.__class__ is list and len(tensors) == 1
                and not opts.asyncOp):
            tensor = tensors[0]
            op = _PLAIN_OPS[int(opts.reduceOp.op)]
            # Tensor.numpy() and the checks before it cost ~2 us: reuse the view of the last
            # tensor while it is the same object over the same memory (same pointer, dtype and
            # size, still contiguous: the same flat buffer to an allreduce).
            last = self._last  # one tuple, replaced whole: safe if two threads race here
            if (tensor is last[0] and op is not None and tensor.data_ptr() == last[1]
                    and tensor.dtype is last[2] and tensor.is_contiguous() and tensor.numel() == last[3].size):
                self.commlib_group.allreduce(last[3], op)
                return self._done
            if (op is not None and tensor.dtype in _NUMPY_DTYPES and not tensor.requires_grad
                    and not tensor.is_cuda and tensor.is_contiguous()):
                array = tensor.numpy()
                if array.nbytes <= _CACHE_BYTES:
                    self._last = (tensor, tensor.data_ptr(), tensor.dtype, array)
                self.commlib_group.allreduce(array, op)
                return self._done
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensor = _single(tensors, "allreduce")
        if opts is None or isinstance(opts, (dist.ReduceOp, _RED)):
            # Called as pg.allreduce(tensor[, op]) (DDP's unused-parameter map does this).
            op_value = _SUM_VALUE if opts is None else _op_value(opts)
            opts = _ASYNC
        else:
            op_value = _op_value(opts.reduceOp)
        return self._allreduce_staged([_Staged(tensor, "allreduce tensor")], op_value, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        staged = [_Staged(t, "allreduce_coalesced tensor") for t in tensors]
        op_value = _SUM_VALUE if opts is None else _op_value(opts.reduceOp)
        return self._allreduce_staged(staged, op_value, opts)

    def _allreduce_staged(self, staged, op_value, opts):
        op, bitwise = _lookup_op(op_value, staged)
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
        copy_back = _copy_back_all(staged)
        if copy_back is not None:
            finishers.append(copy_back)
        return self._finish(opts or _ASYNC, issue, [s.tensor for s in staged],
                            _chain(finishers), staged[0].cuda_device if staged else None)

    # -- one-to-all and all-to-one -------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        tensor = _single(tensors, "broadcast")
        root = 0 if opts is None else opts.rootRank
        staged = _Staged(tensor, "broadcast tensor")
        group = self.commlib_group
        return self._finish(opts or _ASYNC,
                            lambda async_op: group.broadcast(staged.array, root, async_op=async_op),
                            [tensor], _copy_back_all([staged]), staged.cuda_device)

    def reduce(self, tensors, opts=None):
        tensor = _single(tensors, "reduce")
        staged = _Staged(tensor, "reduce tensor")
        op_value = _SUM_VALUE if opts is None else _op_value(opts.reduceOp)
        op, bitwise = _lookup_op(op_value, [staged])
        if bitwise is not None:
            raise InvalidUsageError(f"commlib backend: reduce supports SUM, AVG, MIN, MAX, PRODUCT; got {_RED(op_value).name}")
        root = 0 if opts is None else opts.rootRank
        group = self.commlib_group
        return self._finish(opts or _ASYNC,
                            lambda async_op: group.reduce(staged.array, root, op, async_op=async_op),
                            [tensor], _copy_back_all([staged]), staged.cuda_device)

    def barrier(self, opts=None):
        group = self.commlib_group
        return self._finish(opts or _ASYNC, lambda async_op: group.barrier(async_op=async_op), [])

    # -- gathers and scatters ------------------------------------------------------------------
    def allgather(self, output_lists, input_tensors, opts=None):
        outputs = _single(output_lists, "allgather") if not isinstance(output_lists[0], torch.Tensor) else output_lists
        inp = _Staged(_single(input_tensors, "allgather"), "allgather input")
        self._check_parts(outputs, inp.tensor, "allgather", "output list")
        flat = torch.empty((self.size(),) + tuple(inp.tensor.shape), dtype=inp.tensor.dtype,
                           device=inp.tensor.device)
        flat_staged = _Staged(flat, "allgather staging")
        group = self.commlib_group

        def finish():
            for index, out in enumerate(outputs):
                out.copy_(flat[index])

        return self._finish(opts or _ASYNC,
                            lambda async_op: group.allgather(flat_staged.array, inp.array, async_op=async_op),
                            [outputs], finish, inp.cuda_device)

    def all_gather_single(self, output, input, opts=None):
        out, inp = _Staged(output, "all_gather output"), _Staged(input, "all_gather input")
        group = self.commlib_group
        return self._finish(opts or _ASYNC,
                            lambda async_op: group.allgather(out.array, inp.array, async_op=async_op),
                            [output], _copy_back_all([out]), out.cuda_device)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        works = [self.allgather(outs, [inp], opts) for outs, inp in zip(output_lists, input_tensors)]
        return works[-1] if works else self._done

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(out, inp, opts) for out, inp in zip(outputs, inputs)]
        return works[-1] if works else self._done

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        output = _single(outputs, "reduce_scatter")
        parts = _single(input_lists, "reduce_scatter") if not isinstance(input_lists[0], torch.Tensor) else input_lists
        self._check_parts(parts, output, "reduce_scatter", "input list")
        return self.reduce_scatter_single(output, torch.stack([p.detach() for p in parts]), opts)

    def reduce_scatter_single(self, output, input, opts=None):
        op_value = _SUM_VALUE if opts is None else _op_value(opts.reduceOp)
        out, inp = _Staged(output, "reduce_scatter output"), _Staged(input, "reduce_scatter input")
        op, bitwise = _lookup_op(op_value, [out])
        if bitwise is not None:
            raise InvalidUsageError(f"commlib backend: reduce_scatter supports SUM, AVG, MIN, MAX, PRODUCT; got {_RED(op_value).name}")
        group = self.commlib_group
        return self._finish(opts or _ASYNC,
                            lambda async_op: group.reduce_scatter(out.array, inp.array, op, async_op=async_op),
                            [output], _copy_back_all([out]), out.cuda_device)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(out, inp, opts) for out, inp in zip(outputs, inputs)]
        return works[-1] if works else self._done

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # gather and scatter ride on allgather and broadcast: P times the bytes of a rooted
    # algorithm, but the same collective on every rank (no root-dependent code paths), and
    # gather_object / scatter_object_list are small.
    def gather(self, output_lists, input_tensors, opts=None):
        root = 0 if opts is None else opts.rootRank
        tensor = _single(input_tensors, "gather")
        outputs = output_lists[0] if output_lists else None
        if self.rank() == root:
            self._check_parts(outputs, tensor, "gather", "gather_list")
        flat = torch.empty((self.size(),) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
        work = self.all_gather_single(flat, tensor.contiguous(), _SYNC)
        work.wait()
        if outputs:
            for index, out in enumerate(outputs):
                out.copy_(flat[index])
        return self._done

    def scatter(self, output_tensors, input_lists, opts=None):
        root = 0 if opts is None else opts.rootRank
        output = _single(output_tensors, "scatter")
        flat = torch.empty((self.size(),) + tuple(output.shape), dtype=output.dtype, device=output.device)
        if self.rank() == root:
            parts = input_lists[0]
            self._check_parts(parts, output, "scatter", "scatter_list")
            torch.stack([p.detach() for p in parts], out=flat)
        self.broadcast([flat], _sync_broadcast(root)).wait()
        output.copy_(flat[self.rank()])
        return self._done

    def _check_parts(self, parts, like: torch.Tensor, collective: str, what: str) -> None:
        if len(parts) != self.size():
            raise InvalidUsageError(f"commlib backend: {collective}: {what} has {len(parts)} tensors; expected world size {self.size()}")
        for index, part in enumerate(parts):
            if part.shape != like.shape or part.dtype != like.dtype:
                raise InvalidUsageError(
                    f"commlib backend: {collective}: {what}[{index}] is {part.dtype} {tuple(part.shape)}; "
                    f"expected {like.dtype} {tuple(like.shape)} like this rank's tensor"
                )

    def shutdown(self) -> None:
        self._completer.close()


class _AsyncOptions:
    """Stands in for torch's options when a caller passes none: torch's default is asyncOp=True."""

    asyncOp = True


_ASYNC = _AsyncOptions()


class _SyncOptions:
    asyncOp = False
    rootRank = 0


_SYNC = _SyncOptions()


def _sync_broadcast(root: int) -> _SyncOptions:
    options = _SyncOptions()
    options.rootRank = root
    return options


def _chain(finishers):
    if not finishers:
        return None
    if len(finishers) == 1:
        return finishers[0]

    def run_all():
        for fn in finishers:
            fn()

    return run_all


def _lookup_op(op_value: int, staged):
    try:
        op, bitwise = _OPS[op_value]
    except KeyError:
        raise InvalidUsageError(
            f"commlib backend: unsupported reduce op {_RED(op_value).name}; expected SUM, AVG, MIN, MAX, "
            f"PRODUCT, or BAND/BOR/BXOR on integer tensors"
        ) from None
    if bitwise is not None:
        for s in staged:
            if s.cuda_device is not None:
                raise InvalidUsageError(
                    f"commlib backend: {_RED(op_value).name} is implemented for CPU tensors only; got "
                    f"a tensor on {s.tensor.device}"
                )
            if s.tensor.is_floating_point() or s.tensor.is_complex():
                raise InvalidUsageError(
                    f"commlib backend: {_RED(op_value).name} needs integer or bool tensors; got {s.tensor.dtype}"
                )
    return op, bitwise


def commlib_group_of(group=None) -> "commlib.ProcessGroup":
    """The commlib group under a torch group created with the "commlib" backend (default: world)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(group, CommlibProcessGroup):
        raise InvalidUsageError(f"expected a process group of the {BACKEND_NAME!r} backend, got {group!r}")
    return group.commlib_group


# -- creation and registration -------------------------------------------------------------------
def _create_process_group(options, _backend_options=None) -> CommlibProcessGroup:
    # torch always passes a timeout (30 min unless given): a shorter one is honoured, a longer one
    # is capped by commlib's (COMMLIB_TIMEOUT), which a group that already exists keeps anyway.
    requested = options.timeout.total_seconds() if options.timeout else None
    config_timeout = commlib.load_config().timeout
    timeout = min(requested, config_timeout) if requested and requested > 0 else config_timeout
    world = commlib.init(timeout=timeout)
    members = list(options.global_ranks_in_group)
    rank, size = options.group_rank, options.group_size
    if not members:  # the default group: torch's ranks must be MPI's
        if (rank, size) != (world.rank, world.size):
            raise InvalidUsageError(
                f"the {BACKEND_NAME!r} backend takes its ranks from MPI (launch under mpiexec): MPI "
                f"says rank {world.rank} of {world.size}, but init_process_group got rank={rank}, "
                f"world_size={size}; expected the same numbers"
            )
        return CommlibProcessGroup(world)
    # A subgroup's members are torch's global ranks, taken as MPI's: check that they agree.
    global_rank = dist.get_rank() if dist.is_initialized() else world.rank
    if global_rank != world.rank or members[rank] != world.rank:
        raise InvalidUsageError(
            f"the {BACKEND_NAME!r} backend takes its ranks from MPI: this process is MPI rank "
            f"{world.rank}, but torch's global rank is {global_rank} and the new group places it "
            f"at rank {rank} of {members}; expected torch's ranks to be MPI's (launch under mpiexec)"
        )
    if members == list(range(world.size)):
        sub = world.comm.Dup()
    else:  # only members get here (torch skips the others): a group-collective create
        sub = world.comm.Create_group(world.comm.group.Incl(members), tag=17)
    name = f"torch-{'-'.join(map(str, members))}"
    return CommlibProcessGroup(commlib.ProcessGroup(sub, timeout=timeout, config=world.config,
                                                    debug=world.debug, name=name,
                                                    segment_bytes=world.segment_bytes))


def register() -> None:
    """Register the backend name (done on ``import autograd_bridge``); idempotent."""
    if hasattr(dist.Backend, BACKEND_NAME.upper()):
        return
    # torch 2.13 iterates ``devices``: a plain string would register one device per character.
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True,
                                  devices=["cpu", "cuda"])


def rendezvous_store(comm=None, timeout: timedelta = timedelta(seconds=300)) -> "dist.TCPStore":
    """A TCPStore on rank 0 (port picked by the OS), its address broadcast over MPI."""
    from mpi4py import MPI

    comm = comm or MPI.COMM_WORLD
    hosts = comm.allgather(MPI.Get_processor_name())
    host = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname())
    if comm.Get_rank() == 0:
        store = dist.TCPStore(host, 0, comm.Get_size(), True, timeout, wait_for_workers=False)
        comm.bcast((host, store.port), root=0)
        return store
    host, port = comm.bcast(None, root=0)
    return dist.TCPStore(host, port, comm.Get_size(), False, timeout)


def init_process_group(**kwargs) -> CommlibProcessGroup:
    """Under mpiexec: ``dist.init_process_group("commlib")`` with MPI's rank and size and a store."""
    world = commlib.init()
    if "store" not in kwargs and "init_method" not in kwargs:
        kwargs["store"] = rendezvous_store()
    dist.init_process_group(BACKEND_NAME, rank=world.rank, world_size=world.size, **kwargs)
    return dist.distributed_c10d._get_default_group()
