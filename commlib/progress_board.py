"""Where every rank of a group is: a shared-memory board for naming the peers a timeout waited for.

A native collective (``MPI_Iallreduce``...) that times out cannot say which rank never joined.
So each rank writes, at the start of every collective, ``(sequence number, collective)`` into its
slot of a node-local shared-memory window (``MPI_Win_allocate_shared``): a plain store, no MPI
call, no message. When a rank times out it reads its peers' slots directly (no MPI progress is
needed from a peer that is busy elsewhere or hung) and names those behind it or in a different
collective. Peers on other hosts cannot be read this way and are reported as unknown.
"""

from __future__ import annotations

import atexit
from typing import List

import numpy as np
from mpi4py import MPI

__all__ = ["ProgressBoard", "COLLECTIVE_CODES"]

COLLECTIVE_CODES = {"allreduce": 1, "broadcast": 2, "reduce": 3, "allgather": 4,
                    "reduce_scatter": 5, "barrier": 6, "alltoall": 7, "alltoallv": 8,
                    "alltoallv_counts": 9, "gather": 10, "scatter": 11}
EXITED_CODE = 255  # written at interpreter exit, so peers can tell "exited" from "slow"
_NAMES = {code: name for name, code in COLLECTIVE_CODES.items()}
_CODE_BITS = 8


class ProgressBoard:
    def __init__(self, comm: MPI.Comm):
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self._window = MPI.Win.Allocate_shared(8, 8, comm=self._node_comm)
        node_ranks = comm.Get_group().Translate_ranks(list(range(self.size)), self._node_comm.Get_group())
        self._slots: List = []
        for node_rank in node_ranks:
            if node_rank == MPI.UNDEFINED:
                self._slots.append(None)
            else:
                memory, _ = self._window.Shared_query(node_rank)
                self._slots.append(np.frombuffer(memory, dtype=np.int64, count=1))
        self.mine = self._slots[self.rank]
        self.mine[0] = 0
        # A memoryview store costs a third of a numpy item store; the hot path uses it.
        self.mine_slot = memoryview(self.mine)
        atexit.register(self.mark_exited)

    @staticmethod
    def encode(seq: int, collective: str) -> int:
        return (seq << _CODE_BITS) | COLLECTIVE_CODES.get(collective, 0)

    def started(self, seq: int, collective: str) -> None:
        self.mine[0] = (seq << _CODE_BITS) | COLLECTIVE_CODES.get(collective, 0)

    def laggards(self, seq: int, collective: str) -> str:
        """Text naming the peers that have not started collective ``seq`` (or run another one)."""
        behind, different, unknown = [], [], []
        for peer, slot in enumerate(self._slots):
            if peer == self.rank:
                continue
            if slot is None:
                unknown.append(peer)
                continue
            value = int(slot[0])
            peer_seq, peer_code = value >> _CODE_BITS, value & ((1 << _CODE_BITS) - 1)
            peer_name = _NAMES.get(peer_code, "nothing yet")
            if peer_code == EXITED_CODE:
                behind.append(f"rank {peer} (its process exited after #{peer_seq})")
            elif peer_seq < seq:
                last = f"last started {peer_name} #{peer_seq}" if peer_seq else "started no collective yet"
                behind.append(f"rank {peer} ({last})")
            elif peer_seq == seq and peer_name != collective:
                different.append(f"rank {peer} (called {peer_name} #{peer_seq} instead)")
            elif peer_seq > seq:
                different.append(f"rank {peer} (already at {peer_name} #{peer_seq})")
        parts = []
        if behind:
            parts.append("never heard from " + ", ".join(behind))
        if different:
            parts.append("out of step: " + ", ".join(different))
        if unknown:
            parts.append(f"state unknown for off-node rank(s) {', '.join(map(str, unknown))}")
        if not parts:
            return "every on-node peer entered this collective (one of them may be stuck in it)"
        return "; ".join(parts)

    def mark_exited(self) -> None:
        if self.mine is not None:
            self.mine[0] = (int(self.mine[0]) >> _CODE_BITS << _CODE_BITS) | EXITED_CODE

    def close(self) -> None:
        self._slots = []
        self.mine = None
        if self.mine_slot is not None:
            self.mine_slot.release()
            self.mine_slot = None
        try:
            self._window.Free()
            self._node_comm.Free()
        except MPI.Exception:
            pass
