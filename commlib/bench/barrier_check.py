"""The barrier row's #wrong: did any rank leave the barrier before a peer had entered it?

A barrier has no output to compare with a closed form; what it promises is an order: no rank
returns before every rank has called it. So the check writes that order down where the peers
can read it without going through the barrier: every rank of a host owns a slot of an arrival
board in shared memory (:func:`commlib.shm.segments.map_host_files`, as the progress board).
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
from typing import Callable, ClassVar, Optional

import numpy as np
from commlib.rendezvous.mpi import MPIRendezvous
from commlib.shm.segments import fence, map_host_files

__all__ = ["BarrierCheck", "CHECK_ROUNDS", "LATE_SECONDS"]

CHECK_ROUNDS = 3
LATE_SECONDS = 0.02  # the late rank's head start for the others: far above a barrier's microseconds


class BarrierCheck:
    """Collective over ``comm`` (an mpi4py communicator, or a
    :class:`~commlib.bench.group_comm.GroupComm`): the arrival board of this rank's host.

    The barrier spec's check (:mod:`commlib.bench.specs`): the same interface as the closed-form
    check of the collectives that move data."""

    VERDICT: ClassVar[str] = "barrier exits before a peer arrived"
    LEGEND: ClassVar[str] = (f"exits before a peer of the host had entered, in {CHECK_ROUNDS} more calls with one rank "
              f"{LATE_SECONDS * 1e3:g} ms late in each")

    def __init__(self, comm):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        # An mpi4py communicator, or the benchmarks' GroupComm (no MPI) with its group's rendezvous.
        everyone = getattr(comm, "rendezvous", None) or MPIRendezvous(comm)
        host = everyone.host_local()
        try:
            self.host_rank, host_size = host.rank, host.size
            files = map_host_files(host, 8 * host_size if self.host_rank == 0 else 0,
                                   kind="bench-barrier", peers_writable=True)
        finally:
            host.close()
        self._mapping = files.mappings[0] if files is not None else None
        self.arrivals: Optional[np.ndarray] = None
        if self._mapping is not None:
            self.arrivals = np.frombuffer(self._mapping, dtype=np.int64, count=host_size)
        self.round = 0  # every rank counts the same rounds: the rounds are barrier calls

    def wrong_after(self, run: Callable[[], object], buffers: object = None) -> Optional[int]:
        """Call ``run`` (the barrier) :data:`CHECK_ROUNDS` times; the peers of this rank's host it found not
        yet arrived when it got out, summed over the rounds (None: no board to check on).
        ``buffers``: unused (a barrier has none)."""
        wrong = 0
        for _ in range(CHECK_ROUNDS):
            self.round += 1
            if (self.round - 1) % self.size == self.rank:
                time.sleep(LATE_SECONDS)
            if self.arrivals is not None:
                self.arrivals[self.host_rank] = self.round
                fence()
            run()
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
