"""``ProcessGroup``: the collectives of one set of ranks.

A group owns an MPI communicator (dup'ed, so our traffic never mixes with the user's), the MPI
transport over it, a :class:`CommExecutor` (the ordering and the communication thread), a
point-to-point channel on a communicator of its own (:mod:`.p2p`), and, created on first GPU
use, a GPU backend. Each collective validates its arguments in the caller's thread, then issues
one task that runs the collective against a transport. This file holds allreduce and the
group's machinery; the other collectives are in :mod:`.collectives`, point-to-point in
:mod:`.p2p` (both mixed in).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import numpy as np

from . import algorithms as _algorithms
from .auto import (choose, choose_shared_memory_allreduce, choose_shared_memory_mover, native_threshold,
                   shared_memory_inline_bytes)
from .auto_hosts import choose_across_hosts, native_threshold_across_hosts
from .collectives import CollectiveMethods
from .config import Config
from .errors import InvalidUsageError
from .fingerprint import CallFingerprint
from .executor import CommExecutor
from .crash_witness import witness_endpoint
from .group_inline import set_up_inline_natives
from .group_shared_memory import SharedMemoryMethods
from .host_memory import open_host_memory
from .progress_board import ProgressBoard
from .topology import discover_topology
from .teardown import free_at_exit
from .ops import ReduceOp, check_op
from .p2p import PointToPoint, PointToPointMethods
from .transports.mpi import MPITransport
from .validation import array_kind, check_buffer, check_root, check_timeout

if TYPE_CHECKING:  # the communicator is handed in; only the transport and the bootstrap call MPI
    from mpi4py import MPI

    from .gpu import GpuBackend

__all__ = ["ProcessGroup"]

_SUM = ReduceOp.SUM
_AVG = ReduceOp.AVG
_NDARRAY = np.ndarray  # one global lookup, not a global and a module attribute (the fast path's)


def _allreduce_task(fn, flat, combine, segment_bytes: int, size: int, shared, *, divide: bool):
    """``run(transport)`` for ``_issue``: allreduce ``flat`` with algorithm ``fn`` (against the
    shared-memory transport ``shared`` when it needs one), then divide by ``size`` for an AVG the
    algorithm summed. Not a closure in ``allreduce``: see :func:`commlib.collectives.algorithm_task`.
    """
    def run(transport):
        if size > 1:
            fn(shared or transport, flat, combine, segment_bytes=segment_bytes)
        if divide:
            flat[...] /= size  # in place: flat is a view of buf

    return run


class ProcessGroup(SharedMemoryMethods, CollectiveMethods, PointToPointMethods):
    # allreduce's fast paths by algorithm (commlib/group_inline.py; made below, where "auto"'s
    # limit weighs shared memory and the hosts)
    _allreduce_inline: Dict[str, Callable[..., bool]]
    _allreduce_native_run: Optional[Callable[..., bool]]

    def __init__(self, comm: "MPI.Comm", *, timeout: float, config: Config, debug: bool = False,
                 name: str = "world", segment_bytes: Optional[int] = None, device=None,
                 gpu_transport: Optional[str] = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.name = name
        self.config = config
        self.timeout = check_timeout(timeout, "ProcessGroup")
        self.debug = bool(debug)
        self.segment_bytes = int(segment_bytes or config.segment_bytes)
        self.device = device
        self.gpu_transport = gpu_transport or config.gpu_transport
        self.transport = MPITransport(comm)
        # Which ranks share a host: for algorithms (through the transport), auto, and timeouts.
        self.topology = discover_topology(comm, witness_endpoint())
        self.transport.topology = self.topology
        self.progress = ProgressBoard(comm, self.topology) if self.size > 1 else None
        self.transport.progress_board = self.progress
        # This group's shared memory on its host (symmetric buffers; shm_* algorithms when the
        # whole group is on one host). See commlib/host_memory.py.
        self.host_memory = open_host_memory(comm, config, p2p=self.transport,
                                            progress_board=self.progress) if config.shm else None
        self._shm = (self.host_memory.transport if self.host_memory is not None
                     and self.host_memory.single_host and self.size > 1 else None)
        if self.host_memory is not None and self.topology.spans_hosts:
            self.transport.host_shared_memory = self.host_memory.transport  # hierarchical's phases
        self.executor = CommExecutor(f"group {name!r} rank {self.rank}/{self.size}")
        self._p2p = PointToPoint(comm, timeout=self.timeout, name=name, progress_board=self.progress)
        self._gpu: Optional[GpuBackend] = None
        self._fingerprints = None
        # A few microseconds of Python matter for small collectives: when the group is plain
        # (no debug fingerprints) and "auto" means "native" for small messages, skip the
        # general machinery (see commlib/group_inline.py).
        set_up_inline_natives(self)
        self._small_fast_path_ok = self._allreduce_native_run is not None
        self._auto_native_bytes = native_threshold(self.size, config.algorithm_override)
        self._shm_inline_bytes: float = -1
        if self._shm is not None and not config.algorithm_override and self._small_fast_path_ok:
            # Small messages on one host: counters in shared memory, no MPI call (the transport's
            # slot_round); the MPI fast path is left for what "auto" still sends to MPI.
            self._shm_inline_bytes = min(shared_memory_inline_bytes(self.size), self._shm.layout.slot_bytes)
            self._auto_native_bytes = -1
            self._shm.inline_timeout = self.timeout
            self._shm_allreduce_runner = self.executor.inline_runner(self._shm.slot_round, self._shm_inline_bytes)
        self._cost_model = None
        if self.topology.spans_hosts:  # across hosts "auto" has its own table, or a fitted model
            self._cost_model = load_cost_model(config.cost_model)
            self._auto_native_bytes = native_threshold_across_hosts(
                self.topology, config.algorithm_override, self._cost_model, _algorithms._REGISTRY)
        if self._allreduce_native_run is not None:  # "native": inline at any size, as the general path runs it
            runner = self.executor.inline_runner
            self._allreduce_inline = {"native": runner(self._allreduce_native_run, math.inf)}
            if self._auto_native_bytes >= 0:
                self._allreduce_inline["auto"] = runner(self._allreduce_native_run, self._auto_native_bytes)
        if self.debug:
            from .fingerprint import FingerprintChecker

            self._fingerprints = FingerprintChecker(self)
        free_at_exit(self)

    def __repr__(self) -> str:
        return f"<commlib.ProcessGroup {self.name!r} rank {self.rank} of {self.size}>"

    # -- the collectives -----------------------------------------------------------------------
    def allreduce(self, buf, op=_SUM, *, algorithm: str = "auto", async_op: bool = False):
        if (buf.__class__ is _NDARRAY and buf.nbytes <= self._shm_inline_bytes and not async_op
                and (algorithm == "auto" or algorithm == "shm_oneshot")
                and self._shm_allreduce_runner(buf, op)):
            return None
        fast = self._allreduce_inline.get(algorithm)
        if fast is not None and not async_op and fast(buf, op):
            return None
        if op.__class__ is not ReduceOp:
            op = ReduceOp.coerce(op)
        flat = check_buffer(buf, "allreduce")
        check_op(op, flat.dtype, "allreduce")
        name = self.resolve_algorithm(algorithm, flat.nbytes, on_gpu=buf.__class__ is not np.ndarray,
                                      symmetric=algorithm == "auto" and self._is_symmetric(flat))
        if (name == "native" and algorithm == "auto" and flat.nbytes > self._auto_native_bytes and not async_op
                and self._small_fast_path_ok and self._allreduce_inline["native"](buf, op)):
            # "auto" means the library's own above the small sizes too (across hosts, 32 KiB-8 MiB);
            # another thread issuing meanwhile waits for the issue lock, as it would queue behind.
            return None
        fn = _algorithms.get_algorithm(name)
        size = self.size
        shared = self._shared_memory_for(name, buf) if getattr(fn, "requires_shared_memory", False) else None
        folds_average = op is _AVG and size > 1 and getattr(fn, "folds_average", False)
        combine = op if folds_average else (_SUM if op is _AVG else op)
        run = _allreduce_task(fn, flat, combine, self.segment_bytes, size, shared,
                              divide=op is _AVG and not folds_average)
        return self._issue("allreduce", run, flat.nbytes, async_op, buf, name,
                           CallFingerprint(flat.dtype, buf.shape, op.name, -1, name), kind_of=buf)

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
            sub = transport.split(member, key)
            if sub is not None:
                created["group"] = ProcessGroup(
                    sub, timeout=timeout, config=self.config, debug=self.debug,
                    name=f"{self.name}/{'-'.join(map(str, ranks))}", segment_bytes=self.segment_bytes,
                    device=self.device, gpu_transport=self.gpu_transport)

        self._issue("new_group", create, 0, False, None, "native", CallFingerprint(None, (len(ranks),), "", -1, ""))
        return created.get("group")

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

    def close(self) -> None:
        """Finish the queued collectives, then free what the group holds, its communicator last.

        Local (``MPI_Comm_free`` waits for no peer). Idempotent; runs at exit for open groups.
        """
        self.executor.close()
        self._p2p.close()
        if self._gpu is not None:
            self._gpu.close()
        if self.host_memory is not None:
            self._shm = None
            self.transport.host_shared_memory = None
            self.host_memory.close()
        self.transport.close()
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        self.transport.free_communicator()

    @property
    def seq(self) -> int:
        """How many collectives this group has started (the last one's sequence number)."""
        return self.executor.seq

    def resolve_algorithm(self, algorithm: str, nbytes: int, on_gpu: bool = False,
                          collective: str = "allreduce", symmetric: bool = False) -> str:
        """The algorithm a ``collective`` call with ``algorithm`` and ``nbytes`` runs (resolves "auto");
        ``symmetric``: the call's buffers live in this group's shared memory (``alloc``)."""
        if algorithm == "auto":
            override = self.config.algorithm_override_for(collective)
            if override:
                return override
            if on_gpu:  # NCCL's own collectives beat a Python schedule over NCCL send/recv
                return "native"
            if collective == "allreduce" and self.topology.spans_hosts:
                return choose_across_hosts(nbytes, self.topology, _algorithms._REGISTRY, self._cost_model)
            if self._shm is not None:
                shared = (choose_shared_memory_allreduce(nbytes, self.size, symmetric) if collective == "allreduce"
                          else choose_shared_memory_mover(collective, nbytes, self.size,
                                                          self._shm.cross_memory is not None, symmetric))
                if shared is not None:
                    return shared
            return choose(collective, nbytes, self.size, _algorithms._REGISTRIES[collective])
        if algorithm.__class__ is not str:
            raise InvalidUsageError(f"{collective}: algorithm must be a str, got {algorithm!r}")
        return algorithm

    # -- internals -----------------------------------------------------------------------------
    def _issue(self, collective: str, run, nbytes: int, async_op: bool, result, algorithm: str,
               fingerprint, kind_of=None):
        if kind_of is not None and array_kind(kind_of) == "cupy":
            return self._gpu_backend().issue(collective, run, nbytes, async_op, result, algorithm,
                                             fingerprint)
        transport = self.transport
        context = transport.context
        timeout = self.timeout
        checker = self._fingerprints
        progress = self.progress

        def task(seq):
            if progress is not None:
                progress.started(seq, collective)
            context.begin(collective, seq, algorithm, nbytes, timeout)
            if checker is not None:
                checker.check(collective, seq, algorithm, fingerprint)
            run(transport)

        if not async_op:
            self.executor.run_sync(task, collective, nbytes, result)
            return None
        return self.executor.submit(task, collective, nbytes, result)

    def _gpu_backend(self):
        if self._gpu is None:
            from .gpu import GpuBackend  # imported lazily: cupy is an optional extra

            self._gpu = GpuBackend(self)
        return self._gpu


def load_cost_model(path: Optional[str]):
    """The model ``COMMLIB_COST_MODEL`` names (read once per group that spans hosts), or None."""
    if not path:
        return None
    from .costmodel import CostModel

    return CostModel.load(path)
