"""The barrier row's #wrong: did any rank leave the barrier before a peer had entered it?

A barrier has no output to compare with a closed form; what it promises is an order: no rank
returns before every rank has called it. So the check writes that order down where the peers
can read it without going through the barrier: every rank of a host owns a slot of an arrival
board in shared memory (:func:`commlib.shared_memory.map_host_files`, as the progress board).
In round ``k`` a rank stores ``k`` in its slot, then calls the barrier; after it returns, every
slot of the host must hold ``k`` or more. A slot still below ``k`` is a peer this rank left
without: one wrong. Each round one rank (a different one every round) sleeps before it arrives,
so a barrier that lets ranks out early is caught, not left to the luck of a race; a correct
barrier gives 0 however late anyone is. Memory fences around the store and the read keep the
board's order against the barrier's own messages.

Scope: the ranks of each host check each other (shared memory is per host); across hosts the
row says nothing about pairs on different hosts. Without shared memory (a file could not be
mapped) the check is off and #wrong is None ('-' in the table), never a made-up 0.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from .shared_memory import fence, map_host_files

__all__ = ["BarrierCheck", "CHECK_ROUNDS", "LATE_SECONDS"]

CHECK_ROUNDS = 3
LATE_SECONDS = 0.02  # the late rank's head start for the others: far above a barrier's microseconds


class BarrierCheck:
    """Collective over ``comm`` (an mpi4py communicator): the arrival board of this rank's host."""

    def __init__(self, comm: MPI.Comm):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            self.host_rank, host_size = host_comm.Get_rank(), host_comm.Get_size()
            files = map_host_files(host_comm, 8 * host_size if self.host_rank == 0 else 0, kind="bench-barrier",
                                   peers_writable=True)
        finally:
            host_comm.Free()
        self._mapping = files.mappings[0] if files is not None else None
        self.arrivals: Optional[np.ndarray] = None
        if self._mapping is not None:
            self.arrivals = np.frombuffer(self._mapping, dtype=np.int64, count=host_size)
        self.round = 0  # every rank counts the same rounds: the rounds are barrier calls

    def wrong_after(self, barrier: Callable[[], object]) -> Optional[int]:
        """Call ``barrier`` :data:`CHECK_ROUNDS` times; the peers of this rank's host it found not
        yet arrived when it got out, summed over the rounds (None: no board to check on)."""
        wrong = 0
        for _ in range(CHECK_ROUNDS):
            self.round += 1
            if (self.round - 1) % self.size == self.rank:
                time.sleep(LATE_SECONDS)
            if self.arrivals is not None:
                self.arrivals[self.host_rank] = self.round
                fence()
            barrier()
            if self.arrivals is not None:
                fence()
                # >=: a fast peer may already have arrived at the next round
                wrong += int(np.count_nonzero(self.arrivals < self.round))
        return wrong if self.arrivals is not None else None

    def close(self) -> None:
        """Unmap the board (local: waits for no peer). Idempotent."""
        self.arrivals = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
