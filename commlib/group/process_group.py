"""``ProcessGroup``: the collectives and point-to-point messages of one set of ranks.

A group owns its collaborators, built once in ``__init__`` and never patched afterwards:

* ``rendezvous`` (how its ranks met: :mod:`commlib.rendezvous`) and ``transport`` (how bytes move:
  MPI over a communicator dup'ed for it, so our traffic never mixes with the user's);
* ``topology`` (which ranks share a host), ``progress`` (the progress board: who started what),
  ``host_memory`` (its shared memory on this host: symmetric buffers, the ``shm_*`` schedules);
* ``executor`` (one order of collectives on every rank, the communication thread), ``p2p`` (the
  point-to-point channel: on a communicator of its own under MPI, on a socket mesh of its own
  over the socket transport, none over other transports), ``selector`` (``algorithm="auto"``),
  the small-message fast paths (a table from :func:`.fast_path.build_fast_paths`), and, created on
  first GPU use, a GPU backend.

Each collective validates its arguments in the caller's thread (nothing is sent and no buffer is
written when they are wrong), resolves its algorithm, and issues one task that runs the
algorithm against a transport (the calling conventions are in :mod:`commlib.algorithms.registry`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Union

import numpy as np

from commlib.algorithms.registry import get_algorithm
from commlib.config import Config
from commlib.errors import GroupAbortedError, InvalidUsageError
from commlib.execution.executor import CommExecutor
from commlib.execution.fingerprint import CallFingerprint, FingerprintChecker
from commlib.execution.issue import collective_task
from commlib.group.fast_path import build_fast_paths
from commlib.group.host_memory import no_shared_memory_error, open_host_memory
from commlib.group.p2p import P2PWork, PointToPoint
from commlib.group.socket_p2p import SocketPointToPoint
from commlib.group.tasks import algorithm_task, allreduce_task
from commlib.group.validation import (array_kind, check_buffer, check_counts, check_no_overlap, check_root,
                                      check_same_kind, check_timeout)
from commlib.ops import ReduceOp, check_op
from commlib.reliability.crash_witness import witness_endpoint
from commlib.reliability.progress_board import ProgressBoard
from commlib.reliability.teardown import free_at_exit, run_released_later
from commlib.rendezvous.mpi import MPIRendezvous
from commlib.selection.selector import AlgorithmSelector, load_cost_model
from commlib.topology import discover_topology
from commlib.transports.interface import Transport
from commlib.transports.mpi.transport import MPITransport
from commlib.transports.socket.transport import SocketTransport

if TYPE_CHECKING:  # the communicator is handed in; only the transport and the rendezvous call MPI
    from mpi4py import MPI

    from commlib.gpu import GpuBackend

__all__ = ["ProcessGroup"]

_SUM = ReduceOp.SUM
_AVG = ReduceOp.AVG
_NDARRAY = np.ndarray  # one global lookup, not a global and a module attribute (the fast path's)


class ProcessGroup:
    """The collectives of the ranks of ``comm`` (an MPI communicator, which the group owns from
    here: dup one for it), or of ``transport`` (a transport over ranks that met without MPI, e.g.
    :class:`commlib.transports.socket.SocketTransport`, with its ``rendezvous``): give one."""

    def __init__(self, comm: Optional["MPI.Comm"] = None, *, timeout: float, config: Config, debug: bool = False,
                 name: str = "world", segment_bytes: Optional[int] = None, device=None,
                 gpu_transport: Optional[str] = None, transport: Optional[Transport] = None):
        if (comm is None) == (transport is None):
            raise InvalidUsageError("ProcessGroup: give an MPI communicator or a transport (and not both)")
        #: The group's MPI communicator, or None for a group whose ranks met without MPI.
        self.comm = comm
        self.transport: Transport = MPITransport(comm) if comm is not None else transport  # type: ignore[assignment]
        rendezvous = MPIRendezvous(comm) if comm is not None else self.transport.rendezvous
        if rendezvous is None:
            raise InvalidUsageError(f"ProcessGroup: {self.transport!r} has no rendezvous to set a group up over")
        self.rendezvous = rendezvous
        self.rank = self.rendezvous.rank
        self.size = self.rendezvous.size
        self.name = name
        self.config = config
        self.timeout = check_timeout(timeout, "ProcessGroup")
        self.debug = bool(debug)
        self.segment_bytes = int(segment_bytes or config.segment_bytes)
        self.device = device
        self.gpu_transport = gpu_transport or config.gpu_transport
        # Which ranks share a host: for algorithms (through the transport), auto, and timeouts.
        self.topology = discover_topology(self.rendezvous, witness_endpoint())
        self.transport.topology = self.topology
        self.progress = ProgressBoard(self.rendezvous, self.topology) if self.size > 1 else None
        self.transport.progress_board = self.progress
        # This group's shared memory on its host (symmetric buffers; shm_* algorithms when the
        # whole group is on one host). See commlib/group/host_memory.py.
        self.host_memory = open_host_memory(self.rendezvous, config, p2p=self.transport,
                                            progress_board=self.progress) if config.shm else None
        self._shm = (self.host_memory.transport if self.host_memory is not None
                     and self.host_memory.single_host and self.size > 1 else None)
        if self.host_memory is not None and self.topology.spans_hosts:
            self.transport.host_shared_memory = self.host_memory.transport  # hierarchical's phases
        self.executor = CommExecutor(f"group {name!r} rank {self.rank}/{self.size}")
        self.p2p: Optional[Union[PointToPoint, SocketPointToPoint]] = _point_to_point(
            comm, self.transport, timeout=self.timeout, name=name, progress_board=self.progress)
        self.selector = AlgorithmSelector(
            self.size, self.topology, config, shared_memory=self._shm is not None,
            cross_memory=self._shm is not None and self._shm.cross_memory is not None,
            cost_model=load_cost_model(config.cost_model) if self.topology.spans_hosts else None,
            messages_in_shared_memory=self.transport.local_messages_in_shared_memory)
        #: Debug mode's fingerprint checker (every rank calls the same collective), or None.
        self.fingerprints = FingerprintChecker(self) if self.debug else None
        self._gpu: Optional[GpuBackend] = None
        # A few microseconds of Python matter for small collectives: when the group is plain (no
        # debug fingerprints) and "auto" means the library's own for small messages, skip the
        # general machinery (commlib/group/fast_path.py). One attribute per collective: each
        # lookup on the fast path costs a tenth of its budget.
        fast = build_fast_paths(self.transport, self.executor, size=self.size, timeout=self.timeout,
                                debug=self.debug, config=config, topology=self.topology, shared_memory=self._shm,
                                cost_model=self.selector.cost_model)
        tables = fast.by_collective
        self._fast_allreduce = tables["allreduce"]
        self._fast_broadcast = tables["broadcast"]
        self._fast_reduce = tables["reduce"]
        self._fast_allgather = tables["allgather"]
        self._fast_reduce_scatter = tables["reduce_scatter"]
        self._fast_alltoall = tables["alltoall"]
        self._fast_gather = tables["gather"]
        self._fast_scatter = tables["scatter"]
        self._fast_barrier = tables["barrier"]
        self._shm_allreduce_bytes = fast.shm_allreduce_bytes
        self._shm_allreduce: Callable[..., bool] = fast.shm_allreduce or _declines
        self._auto_native_bytes = fast.auto_native_bytes
        self._native_allreduce_inline = fast.native_allreduce_inline
        self.closed = False
        free_at_exit(self, self.transport.releaser())

    def __repr__(self) -> str:
        return f"<commlib.ProcessGroup {self.name!r} rank {self.rank} of {self.size}>"

    # -- the collectives -----------------------------------------------------------------------
    def allreduce(self, buf, op=_SUM, *, algorithm: str = "auto", async_op: bool = False):
        """Every rank's ``buf`` becomes the reduction (``op``) of every rank's, in place."""
        if (buf.__class__ is _NDARRAY and buf.nbytes <= self._shm_allreduce_bytes and not async_op
                and (algorithm == "auto" or algorithm == "shm_oneshot") and self._shm_allreduce(buf, op)):
            return None
        fast = self._fast_allreduce.get(algorithm)
        if fast is not None and not async_op and fast(buf, op):
            return None
        if op.__class__ is not ReduceOp:
            op = ReduceOp.coerce(op)
        flat = check_buffer(buf, "allreduce")
        check_op(op, flat.dtype, "allreduce")
        name = self.selector.resolve(algorithm, flat.nbytes, on_gpu=buf.__class__ is not np.ndarray,
                                     symmetric=algorithm == "auto" and self._is_symmetric(flat))
        if (name == "native" and algorithm == "auto" and flat.nbytes > self._auto_native_bytes and not async_op
                and self._native_allreduce_inline and self._fast_allreduce["native"](buf, op)):
            # "auto" means the library's own above the small sizes too (across hosts, 32 KiB-8 MiB);
            # another thread issuing meanwhile waits for the issue lock, as it would queue behind.
            return None
        fn = get_algorithm(name)
        size = self.size
        shared = self._shared_memory_for(name, buf) if getattr(fn, "requires_shared_memory", False) else None
        folds_average = op is _AVG and size > 1 and getattr(fn, "folds_average", False)
        combine = op if folds_average else (_SUM if op is _AVG else op)
        run = allreduce_task(fn, flat, combine, self.segment_bytes, size, shared,
                             divide=op is _AVG and not folds_average)
        return self._issue("allreduce", run, flat.nbytes, async_op, buf, name,
                           CallFingerprint(flat.dtype, buf.shape, op.name, -1, name), kind_of=buf)

    def broadcast(self, buf, root: int = 0, *, algorithm: str = "auto", async_op: bool = False):
        """Every rank's ``buf`` becomes ``root``'s."""
        fast = self._fast_broadcast.get(algorithm)
        if fast is not None and not async_op and fast(buf, root):
            return None
        flat = check_buffer(buf, "broadcast")
        root = check_root(root, self.size, "broadcast")
        name, fn, shared = self._algorithm("broadcast", algorithm, flat.nbytes, buf)
        run = algorithm_task(fn, (flat, root), self.segment_bytes, shared=shared)
        return self._issue("broadcast", run, flat.nbytes, async_op, buf, name,
                           CallFingerprint(flat.dtype, buf.shape, "", root, name), kind_of=buf)

    def reduce(self, buf, root: int = 0, op=_SUM, *, algorithm: str = "auto", async_op: bool = False):
        """``root``'s ``buf`` becomes the reduction of every rank's; the others' stay as they were."""
        fast = self._fast_reduce.get(algorithm)
        if fast is not None and not async_op and fast(buf, root, op):
            return None
        op = ReduceOp.coerce(op)
        flat = check_buffer(buf, "reduce")
        check_op(op, flat.dtype, "reduce")
        root = check_root(root, self.size, "reduce")
        name, fn, shared = self._algorithm("reduce", algorithm, flat.nbytes, buf)
        combine = _SUM if op is _AVG else op
        run = algorithm_task(fn, (flat, root, combine), self.segment_bytes, shared=shared,
                             average=flat if op is _AVG and self.rank == root else None, size=self.size)
        return self._issue("reduce", run, flat.nbytes, async_op, buf, name,
                           CallFingerprint(flat.dtype, buf.shape, op.name, root, name), kind_of=buf)

    def allgather(self, out, inp, *, algorithm: str = "auto", async_op: bool = False):
        """``out`` (``size * inp.size``) gets every rank's ``inp``, rank-major."""
        fast = self._fast_allgather.get(algorithm)
        if fast is not None and not async_op and fast(out, inp):
            return None
        flat_out, flat_inp = self._out_and_inp("allgather", out, inp)
        self._check_size("allgather", "out", flat_out.size, "inp", flat_inp.size)
        name, fn, shared = self._algorithm("allgather", algorithm, flat_out.nbytes, out, (flat_out, flat_inp))
        run = algorithm_task(fn, (flat_out, flat_inp), self.segment_bytes, shared=shared)
        return self._issue("allgather", run, flat_out.nbytes, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, inp.shape, "", -1, name), kind_of=out)

    def reduce_scatter(self, out, inp, op=_SUM, *, algorithm: str = "auto", async_op: bool = False):
        """Rank ``r``'s ``out`` gets block ``r`` of the reduction of every rank's ``inp``."""
        fast = self._fast_reduce_scatter.get(algorithm)
        if fast is not None and not async_op and fast(out, inp, op):
            return None
        op = ReduceOp.coerce(op)
        flat_out, flat_inp = self._out_and_inp("reduce_scatter", out, inp)
        check_op(op, flat_out.dtype, "reduce_scatter")
        self._check_size("reduce_scatter", "inp", flat_inp.size, "out", flat_out.size)
        name, fn, shared = self._algorithm("reduce_scatter", algorithm, flat_inp.nbytes, out)
        combine = _SUM if op is _AVG else op
        run = algorithm_task(fn, (flat_out, flat_inp, combine), self.segment_bytes, shared=shared,
                             average=flat_out if op is _AVG else None, size=self.size)
        return self._issue("reduce_scatter", run, flat_inp.nbytes, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, inp.shape, op.name, -1, name), kind_of=out)

    def alltoall(self, out, inp, *, algorithm: str = "auto", async_op: bool = False):
        """Block ``j`` of rank ``i``'s ``inp`` lands in block ``i`` of rank ``j``'s ``out`` (equal blocks)."""
        fast = self._fast_alltoall.get(algorithm)
        if fast is not None and not async_op and fast(out, inp):
            return None
        flat_out, flat_inp = self._out_and_inp("alltoall", out, inp)
        if flat_out.size != flat_inp.size or flat_inp.size % self.size:
            raise InvalidUsageError(
                f"alltoall: inp has {flat_inp.size} and out {flat_out.size} elements; expected the same "
                f"size, a multiple of the world size {self.size} (one equal block per rank; alltoallv "
                f"takes unequal ones)")
        name, fn, shared = self._algorithm("alltoall", algorithm, flat_inp.nbytes, out, (flat_out, flat_inp))
        run = algorithm_task(fn, (flat_out, flat_inp), self.segment_bytes, shared=shared)
        return self._issue("alltoall", run, flat_inp.nbytes, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, inp.shape, "", -1, name), kind_of=out)

    def alltoallv(self, out, inp, out_counts, in_counts, *, algorithm: str = "auto", async_op: bool = False):
        """``in_counts[j]`` elements of ``inp`` go to rank ``j``, ``out_counts[i]`` arrive from rank ``i``.

        Blocks are consecutive in rank order. Before any data moves, the ranks exchange their
        counts (a small synchronous collective, also with ``async_op``) so that counts that do
        not match raise :class:`InvalidUsageError` on every rank, naming the pairs.
        """
        flat_out, flat_inp = self._out_and_inp("alltoallv", out, inp)
        out_counts = check_counts(out_counts, self.size, "alltoallv", "out_counts", flat_out.size, "out")
        in_counts = check_counts(in_counts, self.size, "alltoallv", "in_counts", flat_inp.size, "inp")
        name, fn, shared = self._algorithm("alltoallv", algorithm, 0, out)
        self._agree_on_counts(out_counts, in_counts)
        run = algorithm_task(fn, (flat_out, flat_inp, out_counts, in_counts), self.segment_bytes, shared=shared)
        return self._issue("alltoallv", run, flat_inp.nbytes, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, ("v",), "", -1, name), kind_of=out)

    def gather(self, out, inp, root: int = 0, *, algorithm: str = "auto", async_op: bool = False):
        """``root``'s ``out`` (``size * inp.size``) gets every rank's ``inp``; elsewhere ``out`` may be None."""
        fast = self._fast_gather.get(algorithm)
        if fast is not None and not async_op and fast(out, inp, root):
            return None
        root = check_root(root, self.size, "gather")
        flat_inp = check_buffer(inp, "gather", "inp", writable=False)
        flat_out = None
        if self.rank == root:
            flat_out, flat_inp = self._out_and_inp("gather", out, inp, needed_on=f"the root (rank {root})")
            self._check_size("gather", "out", flat_out.size, "inp", flat_inp.size)
        name, fn, shared = self._algorithm("gather", algorithm, flat_inp.nbytes * self.size, inp)
        run = algorithm_task(fn, (flat_out, flat_inp, root), self.segment_bytes, shared=shared)
        return self._issue("gather", run, flat_inp.nbytes * self.size, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, inp.shape, "", root, name), kind_of=inp)

    def scatter(self, out, inp, root: int = 0, *, algorithm: str = "auto", async_op: bool = False):
        """Rank ``r``'s ``out`` gets block ``r`` of ``root``'s ``inp``; elsewhere ``inp`` may be None."""
        fast = self._fast_scatter.get(algorithm)
        if fast is not None and not async_op and fast(out, inp, root):
            return None
        root = check_root(root, self.size, "scatter")
        flat_out = check_buffer(out, "scatter", "out")
        flat_inp = None
        if self.rank == root:
            flat_out, flat_inp = self._out_and_inp("scatter", out, inp, needed_on=f"the root (rank {root})")
            self._check_size("scatter", "inp", flat_inp.size, "out", flat_out.size)
        name, fn, shared = self._algorithm("scatter", algorithm, flat_out.nbytes * self.size, out)
        run = algorithm_task(fn, (flat_out, flat_inp, root), self.segment_bytes, shared=shared)
        return self._issue("scatter", run, flat_out.nbytes * self.size, async_op, out, name,
                           CallFingerprint(flat_out.dtype, out.shape, "", root, name), kind_of=out)

    def barrier(self, *, algorithm: str = "auto", async_op: bool = False):
        """Returns once every rank of the group has entered the barrier."""
        fast = self._fast_barrier.get(algorithm)
        if fast is not None and not async_op and fast():
            return None
        name, fn, shared = self._algorithm("barrier", algorithm, 0, None)
        run = algorithm_task(fn, (), self.segment_bytes, shared=shared)
        return self._issue("barrier", run, 0, async_op, None, name, CallFingerprint(None, (), "", -1, name))

    # -- point to point (a channel of the group's own: commlib/group/p2p.py, socket_p2p.py) -----
    def send(self, buf, dst: int, tag: int = 0, *, timeout: Optional[float] = None) -> None:
        """Send ``buf`` to rank ``dst`` of this group; returns once the bytes were taken (a small
        message: handed on; a large one: received)."""
        self._channel("send").send(buf, dst, tag, timeout)

    def recv(self, buf, src: int, tag: int = 0, *, timeout: Optional[float] = None) -> int:
        """Receive exactly ``buf.nbytes`` from ``src`` (or ``commlib.ANY_SOURCE``); return the sender."""
        return self._channel("recv").recv(buf, src, tag, timeout)

    def isend(self, buf, dst: int, tag: int = 0, *, timeout: Optional[float] = None) -> P2PWork:
        """Start sending ``buf``; do not write it until the returned work completed."""
        return self._channel("isend").isend(buf, dst, tag, timeout)

    def irecv(self, buf, src: int, tag: int = 0, *, timeout: Optional[float] = None) -> P2PWork:
        """Start receiving into ``buf``; the work's ``source`` names the sender once complete."""
        return self._channel("irecv").irecv(buf, src, tag, timeout)

    def monitored_barrier(self, timeout: Optional[float] = None, *, wait_all_ranks: bool = False) -> None:
        """A barrier through rank 0 that names the ranks that did not arrive within ``timeout``."""
        self._channel("monitored_barrier").monitored_barrier(timeout, wait_all_ranks)

    def _channel(self, what: str) -> Union[PointToPoint, SocketPointToPoint]:
        if self.p2p is None:
            raise InvalidUsageError(f"{what}: {self!r} has no point-to-point channel over {self.transport!r} "
                                    f"(point-to-point runs over MPI or the socket transport)")
        return self.p2p

    # -- symmetric buffers ---------------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32) -> np.ndarray:
        """A **symmetric buffer**: a numpy array in this rank's shared memory, at the same place on
        every rank of the host, so an allreduce on it reads the peers' arrays where they are (no
        staging copy, no message). Collective: every rank calls it with the same shape and dtype
        (checked), in the same order as the other collectives. Contents start unspecified (zeros
        when fresh). Freed when the last reference to it (or a view of it) dies; its pages go
        back to the system at once, its place once every rank has dropped it.
        """
        if self.host_memory is None:
            raise no_shared_memory_error("alloc", "", self.config, self)
        return self.host_memory.alloc(self, shape, dtype)

    @property
    def prefers_symmetric_buffers(self) -> bool:
        """Whether buffers from :meth:`alloc` make this group's allreduce faster: its ranks share
        one host and shared memory is on (elsewhere MPI moves the bytes, and MPI was slower on
        shared mappings than on private memory)."""
        return self._shm is not None

    # -- groups --------------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], *, timeout: Optional[float] = None) -> Optional["ProcessGroup"]:
        """A group of ``ranks`` (ranks of this group). Collective: every rank of this group calls it.

        Ranks not in ``ranks`` get ``None``. Ranks are ordered as listed. Every rank must pass the
        same list (checked: ``InvalidUsageError`` on every rank otherwise). Bounded: a rank that
        never arrives, or dies midway, ends in ``CommTimeoutError`` within the timeout, not a hang.
        """
        ranks = [check_root(r, self.size, "new_group") for r in ranks]
        if len(set(ranks)) != len(ranks) or not ranks:
            raise InvalidUsageError(f"new_group: ranks must be a non-empty list without repeats, got {ranks}")
        timeout = self.timeout if timeout is None else check_timeout(timeout, "new_group")
        # Agree on the request with the timed collectives first: a rank that is missing or asks
        # for another group is found here, before the blocking MPI calls that create the group.
        self._agree_on_members(ranks)
        member = self.rank in ranks
        key = ranks.index(self.rank) if member else 0
        created = {}

        def create(transport):
            sub = transport.split(member, key)  # MPI: a communicator; others: a transport of the sub-group
            if sub is not None:
                link = {"transport": sub} if isinstance(sub, Transport) else {"comm": sub}
                created["group"] = ProcessGroup(
                    timeout=timeout, config=self.config, debug=self.debug,
                    name=f"{self.name}/{'-'.join(map(str, ranks))}", segment_bytes=self.segment_bytes,
                    device=self.device, gpu_transport=self.gpu_transport, **link)

        self._issue("new_group", create, 0, False, None, "native", CallFingerprint(None, (len(ranks),), "", -1, ""))
        return created.get("group")

    def resolve_algorithm(self, algorithm: str, nbytes: int, on_gpu: bool = False,
                          collective: str = "allreduce", symmetric: bool = False) -> str:
        """The algorithm a ``collective`` call with ``algorithm`` and ``nbytes`` runs (resolves "auto");
        ``symmetric``: the call's buffers live in this group's shared memory (``alloc``)."""
        return self.selector.resolve(algorithm, nbytes, on_gpu, collective, symmetric)

    @property
    def seq(self) -> int:
        """How many collectives this group has started (the last one's sequence number)."""
        return self.executor.seq

    def gpu_backend(self, transport: Optional[str] = None, device: Optional[int] = None) -> "GpuBackend":
        """This group's GPU backend (created on first use; local, not collective): how collectives
        on CuPy arrays run. ``transport`` ("nccl", "host_staged") and ``device`` choose, before its
        first GPU collective; asking for another transport afterwards is an error."""
        if self._gpu is None:
            if self.comm is None:
                raise InvalidUsageError(f"{self!r}: collectives on GPU buffers need a job launched with mpiexec "
                                        f"(the GPU backend meets its peers over MPI); this group's ranks met "
                                        f"through a store")
            from commlib.gpu import GpuBackend  # imported lazily: cupy is an optional extra

            self._gpu = GpuBackend(self, transport=transport, device=device)
        elif transport is not None and self._gpu.kind != transport:
            raise InvalidUsageError(f"{self!r}: GPU backend already created with transport "
                                    f"{self._gpu.kind!r}; cannot switch to {transport!r}")
        return self._gpu

    def abort(self, reason: str) -> None:
        """From any thread: end what this group does now and will do, with a
        :class:`~commlib.errors.GroupAbortedError` naming ``reason``; its peers hear it at once
        (an ABORT on every connection) and fail the same way. For whoever knows that a collective
        cannot finish although no peer has left: a coordinator that lost a member's heartbeat (a
        host cut off from the network sends nothing, not even a close).

        Groups over the socket transport only, and their waits on sockets: a wait in shared memory
        among a host's ranks still ends at its deadline. MPI cannot end one communicator's
        collective (the MPICH wheel has no revoke): :class:`InvalidUsageError` there. The group
        must still be closed."""
        try:
            self.transport.interrupt(GroupAbortedError(f"group {self.name!r} rank {self.rank} of {self.size}: "
                                                       f"aborted: {reason}"))
        except NotImplementedError:
            raise InvalidUsageError(f"{self!r}.abort: {self.transport!r} cannot be interrupted (only the socket "
                                    f"transport can); end the job instead") from None
        if isinstance(self.p2p, SocketPointToPoint):
            self.p2p.engine.close(reason)

    def close(self) -> None:
        """Finish the queued collectives, then free what the group holds, its communicator last.

        Local (``MPI_Comm_free`` waits for no peer). Idempotent; runs at exit for open groups.
        """
        self.executor.close()
        if self.p2p is not None:
            self.p2p.close()
        if self._gpu is not None:
            self._gpu.close()
        if self.host_memory is not None:
            self._shm = None
            self.selector.shared_memory = False
            self.transport.host_shared_memory = None
            self.host_memory.close()
        self.transport.close()
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        self.transport.free_communicator()
        self.closed = True
        run_released_later()  # groups collected unclosed (commlib.reliability.teardown)

    # -- internals -----------------------------------------------------------------------------
    def _issue(self, collective: str, run, nbytes: int, async_op: bool, result, algorithm: str,
               fingerprint, kind_of=None):
        if kind_of is not None and array_kind(kind_of) == "cupy":
            return self.gpu_backend().issue(collective, run, nbytes, async_op, result, algorithm, fingerprint)
        task = collective_task(run, self.transport, collective, algorithm, nbytes, fingerprint,
                               timeout=self.timeout, progress=self.progress, fingerprints=self.fingerprints)
        if not async_op:
            self.executor.run_sync(task, collective, nbytes, result)
            return None
        return self.executor.submit(task, collective, nbytes, result)

    def _algorithm(self, collective: str, algorithm, nbytes: int, buf, everything=()):
        """``(name, fn, shared)``: the algorithm to run, and the shared-memory transport it needs
        (None for the others; InvalidUsageError where it cannot have one). ``everything``: every
        buffer of the call, where ``"auto"`` chooses by whether all of them are symmetric."""
        on_gpu = buf is not None and buf.__class__ is not np.ndarray
        symmetric = algorithm == "auto" and bool(everything) and all(map(self._is_symmetric, everything))
        name = self.selector.resolve(algorithm, nbytes, on_gpu, collective, symmetric)
        fn = get_algorithm(name, collective)
        if getattr(fn, "requires_shared_memory", False):
            return name, fn, self._shared_memory_for(name, buf, collective)
        return name, fn, None

    def _is_symmetric(self, flat) -> bool:
        """Whether ``flat`` lives in this group's shared memory on this rank (for ``"auto"``)."""
        return self._shm is not None and flat.__class__ is np.ndarray and self._shm.locate(flat) is not None

    def _shared_memory_for(self, name: str, buf, collective: str = "allreduce"):
        """The shared-memory transport for ``collective``'s algorithm ``name``, or
        InvalidUsageError saying why not."""
        if self._shm is not None and buf.__class__ is np.ndarray:
            return self._shm
        if self.host_memory is None:
            raise no_shared_memory_error(collective, name, self.config, self)
        return self.host_memory.transport_for(name, buf, collective, self.size)

    def _out_and_inp(self, collective: str, out, inp, needed_on: str = ""):
        for name, buf in (("out", out), ("inp", inp)):
            if buf is None:
                raise InvalidUsageError(f"{collective}: {name} is None; expected an array"
                                        + (f" on {needed_on}" if needed_on else ""))
        flat_out = check_buffer(out, collective, "out")
        flat_inp = check_buffer(inp, collective, "inp", writable=False)
        check_same_kind(collective, out=out, inp=inp)
        check_no_overlap(collective, flat_out, flat_inp)
        return flat_out, flat_inp

    def _check_size(self, collective: str, big: str, big_size: int, small: str, small_size: int) -> None:
        if big_size != self.size * small_size:
            raise InvalidUsageError(
                f"{collective}: {big} has {big_size} elements; expected world size {self.size} x "
                f"{small}.size {small_size} = {self.size * small_size}")

    def _agree_on_counts(self, out_counts, in_counts) -> None:
        """Every rank sees every rank's counts; any mismatch raises the same error everywhere."""
        size = self.size
        mine = np.array(out_counts + in_counts, np.int64)
        everyone = mine
        if size > 1:
            everyone = np.empty(2 * size * size, np.int64)

            def run(transport):  # never raises: all ranks decide alike, and the group stays usable
                transport.native_allgather(everyone, mine)

            self._issue("alltoallv_counts", run, everyone.nbytes, False, None, "native",
                        CallFingerprint(mine.dtype, mine.shape, "", -1, "native"))
        table = everyone.reshape(size, 2, size)  # [rank, out/in, peer]
        wrong = [f"rank {sender} sends {table[sender, 1, receiver]} to rank {receiver}, which expects "
                 f"{table[receiver, 0, sender]}"
                 for sender in range(size) for receiver in range(size)
                 if table[sender, 1, receiver] != table[receiver, 0, sender]]
        if wrong:
            shown = "; ".join(wrong[:8]) + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
            raise InvalidUsageError(f"alltoallv: rank {self.rank}: the ranks' counts disagree (in_counts[j] "
                                    f"of rank i must equal out_counts[i] of rank j): {shown}")

    def _agree_on_members(self, ranks: List[int]) -> None:
        """Every rank passed the same ``ranks``, or ``InvalidUsageError`` on every rank."""
        if self.size == 1:
            return
        lengths = np.empty(self.size, np.int64)
        self.allgather(lengths, np.array([len(ranks)], np.int64))
        width = int(lengths.max())
        mine = np.full(width, -1, np.int64)
        mine[:len(ranks)] = ranks
        everyone = np.empty((self.size, width), np.int64)
        self.allgather(everyone, mine)
        asked = [everyone[r, :int(lengths[r])].tolist() for r in range(self.size)]
        if any(request != asked[0] for request in asked):
            shown = "; ".join(f"rank {r}: {request}" for r, request in enumerate(asked))
            raise InvalidUsageError(f"new_group: every rank of {self!r} must pass the same ranks; got {shown}")


def _point_to_point(comm, transport: Transport, **options) -> Optional[Union[PointToPoint, SocketPointToPoint]]:
    """The group's point-to-point channel: on a communicator of its own under MPI, on a socket
    mesh of its own over the socket transport (collective: built by every rank), else none."""
    if comm is not None:
        return PointToPoint(comm, **options)
    if isinstance(transport, SocketTransport):
        return SocketPointToPoint(transport, **options)
    return None


def _declines(*_args) -> bool:
    """The fast path of a group that has none: never taken."""
    return False
