"""The shared-memory side of ``ProcessGroup``: symmetric buffers and the one-host fast path.

A mixin, so that ``group.py`` stays about ordering and dispatch; the memory itself is in
:mod:`commlib.host_memory`, the transport in :mod:`commlib.transports.shm`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from .errors import InvalidUsageError
from .ops import DTYPE_IS_FLOAT, ReduceOp
from .validation import array_kind

if TYPE_CHECKING:
    from .config import Config
    from .executor import CommExecutor
    from .host_memory import HostMemory
    from .transports.shm import SharedMemoryTransport

__all__ = ["SharedMemoryMethods"]

_AVG = ReduceOp.AVG


class SharedMemoryMethods:
    # Set by ProcessGroup, which mixes this in.
    size: int
    config: Config
    executor: CommExecutor
    host_memory: Optional[HostMemory]
    _shm: Optional[SharedMemoryTransport]
    _shm_allreduce_runner: Callable[..., bool]  # executor.inline_runner(_shm_allreduce_run()), set by the group
    _progress_slot: Optional[memoryview]

    def alloc(self, shape, dtype=np.float32) -> np.ndarray:
        """A **symmetric buffer**: a numpy array in this rank's shared memory, at the same place on
        every rank of the host, so an allreduce on it reads the peers' arrays where they are (no
        staging copy, no message). Collective: every rank calls it with the same shape and dtype
        (checked), in the same order as the other collectives. Contents start unspecified (zeros
        when fresh). Freed when the last reference to it (or a view of it) dies; its pages go
        back to the system at once, its place once every rank has dropped it.
        """
        if self.host_memory is None:
            raise InvalidUsageError(f"alloc: {self!r} has no shared memory "
                                    f"({'COMMLIB_SHM=0' if not self.config.shm else 'it could not be set up'})")
        return self.host_memory.alloc(self, shape, dtype)

    @property
    def prefers_symmetric_buffers(self) -> bool:
        """Whether buffers from :meth:`alloc` make this group's allreduce faster: its ranks share
        one host and shared memory is on (elsewhere MPI moves the bytes, and MPI was slower on
        shared mappings than on private memory)."""
        return self._shm is not None

    # -- internals -----------------------------------------------------------------------------
    def _is_symmetric(self, flat) -> bool:
        """Whether ``flat`` lives in this group's shared memory on this rank (for ``"auto"``)."""
        return self._shm is not None and flat.__class__ is np.ndarray and self._shm.locate(flat) is not None

    def _shared_memory_for(self, name: str, buf):
        """The shared-memory transport for algorithm ``name``, or InvalidUsageError saying why not."""
        if self._shm is not None and buf.__class__ is np.ndarray:
            return self._shm
        if buf.__class__ is not np.ndarray and array_kind(buf) != "numpy":
            why = "it works on host memory; this buffer is on a GPU"
        elif self.host_memory is None:
            why = "this group has no shared memory (" + ("COMMLIB_SHM=0" if not self.config.shm else
                                                         "it could not be set up") + ")"
        elif not self.host_memory.single_host:
            why = (f"the group spans several hosts (this host has ranks {self.host_memory.host_ranks} of "
                   f"{self.size}); it would leave out the other hosts' ranks: use a hierarchical "
                   f"algorithm or 'auto'")
        else:  # one rank: nothing to reduce, a valid call
            return self.host_memory.transport
        raise InvalidUsageError(f"allreduce: algorithm {name!r} reads the peers' memory directly, "
                                f"so only within one host: {why}")

    def _shm_allreduce_run(self):
        """``run(seq, limit, buf, op)``: ``shm_oneshot`` of ``buf`` right here, as collective ``seq``,
        for the executor's inline runner (``_shm_allreduce_runner``); False: take the general path.

        Like the MPI fast path (:mod:`commlib.group_inline`): no thread hop, no Work; anything
        unusual (AVG of integers, an unsupported dtype, a read-only buffer) falls through to the
        general path, which validates and explains. ``allreduce`` checked the class, the size
        limit and the algorithm. The budget is about a microsecond: one closure over what it
        touches, the checks inside it (every Python call costs a tenth of the budget).
        """
        shm = self._shm
        assert shm is not None  # built only with shared memory (see ProcessGroup.__init__)
        progress_slot = self._progress_slot if self._progress_slot is not None else [0]

        def run(seq: int, _limit, buf, op, _unused=None) -> bool:
            last = shm._last_round  # (count, dtype, op, round): the same kind of call was validated before
            if last is not None and last[0] == buf.size and last[1] is buf.dtype and last[2] is op:
                round_ = last[3]
            else:
                if op.__class__ is not ReduceOp:
                    return False
                is_float = DTYPE_IS_FLOAT.get(buf.dtype)
                if is_float is None or (op is _AVG and not is_float):
                    return False
                round_ = shm.slot_round(buf.dtype, op, buf.size)
            flags = buf.flags
            if not (flags.c_contiguous and flags.writeable):
                return False
            progress_slot[0] = (seq << 8) | 1  # ProgressBoard.started(seq, "allreduce"), inlined
            shm.inline_seq = seq  # the context, should it be needed (see SharedMemoryTransport)
            shm.inline_nbytes = nbytes = buf.nbytes
            round_(buf if buf.ndim == 1 else buf.reshape(-1), nbytes)
            return True

        return run
