"""The shared-memory side of ``ProcessGroup``: symmetric buffers and the one-host fast path.

A mixin, so that ``group.py`` stays about ordering and dispatch; the memory itself is in
:mod:`commlib.host_memory`, the transport in :mod:`commlib.transports.shm`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from .errors import InvalidUsageError
from .validation import array_kind

if TYPE_CHECKING:
    from .config import Config
    from .executor import CommExecutor
    from .host_memory import HostMemory
    from .transports.shm import SharedMemoryTransport

__all__ = ["SharedMemoryMethods"]


class SharedMemoryMethods:
    # Set by ProcessGroup, which mixes this in.
    size: int
    config: Config
    executor: CommExecutor
    host_memory: Optional[HostMemory]
    _shm: Optional[SharedMemoryTransport]
    _shm_allreduce_runner: Callable[..., bool]  # executor.inline_runner(_shm.slot_round), set by the group

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

    def _shared_memory_for(self, name: str, buf, collective: str = "allreduce"):
        """The shared-memory transport for ``collective``'s algorithm ``name``, or
        InvalidUsageError saying why not."""
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
        raise InvalidUsageError(f"{collective}: algorithm {name!r} reads the peers' memory directly, "
                                f"so only within one host: {why}")
