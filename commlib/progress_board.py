"""Where every rank of a group is: a shared-memory board for naming the peers a timeout waited for.

A native collective (``MPI_Iallreduce``...) that times out cannot say which rank never joined.
So each rank writes, at the start of every collective, ``(sequence number, collective)`` into its
slot of a node-local shared-memory board: a plain store, no MPI call, no message. When a rank
times out it reads its peers' slots directly (no MPI progress is needed from a peer that is busy
elsewhere or hung) and names those behind it or in a different collective. Peers on other hosts
cannot be read this way and are reported as unknown.

The board is an ordinary shared file mapping, not an MPI window: ``MPI_Win_free`` is collective
(measured with MPICH 5.0.2: a rank freeing the window at exit waited there until its peer exited,
6 s later), and a window left unfreed makes MPI_Finalize fail over OFI ("fabricclose ... Device or
resource busy", exit 15 on every rank). A mapping is released by each rank alone, at any time,
and stays readable to the peers after its writer exited, so "its process exited" (written at
exit) is still seen. The file is unlinked as soon as every rank of the node has mapped it: a rank
killed later leaves nothing behind.
"""

from __future__ import annotations

import mmap
import os
import secrets
import sys
import tempfile
from typing import List, Optional

import numpy as np
from mpi4py import MPI

__all__ = ["ProgressBoard", "COLLECTIVE_CODES"]

COLLECTIVE_CODES = {"allreduce": 1, "broadcast": 2, "reduce": 3, "allgather": 4,
                    "reduce_scatter": 5, "barrier": 6, "new_group": 7, "alltoall": 8,
                    "alltoallv": 9, "alltoallv_counts": 10, "gather": 11, "scatter": 12}
EXITED_CODE = 255  # written at interpreter exit, so peers can tell "exited" from "slow"
_NAMES = {code: name for name, code in COLLECTIVE_CODES.items()}
_CODE_BITS = 8
_SLOT_BYTES = 8


class ProgressBoard:
    def __init__(self, comm: MPI.Comm):
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            node_ranks = comm.Get_group().Translate_ranks(list(range(self.size)), node_comm.Get_group())
            self._mapping = _map_shared_board(node_comm)
        finally:
            node_comm.Free()
        self._slots: List = []
        if self._mapping is not None:
            board = np.frombuffer(self._mapping, dtype=np.int64)
            self._slots = [None if node_rank == MPI.UNDEFINED else board[node_rank:node_rank + 1]
                           for node_rank in node_ranks]
            self.mine = self._slots[self.rank]
        else:  # no shared memory: this rank keeps its own slot, its peers are "unknown"
            self._slots = [None] * self.size
            self.mine = np.zeros(1, np.int64)
        self.mine[0] = 0
        # A memoryview store costs a third of a numpy item store; the hot path uses it.
        self.mine_slot = memoryview(self.mine)

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

    def exited_before(self, seq: int) -> List[int]:
        """On-node peers whose process exited before starting collective ``seq`` (it can never
        complete with them). One that exited after starting it may have done its part."""
        gone = []
        for peer, slot in enumerate(self._slots):
            if slot is None or peer == self.rank:
                continue
            value = int(slot[0])
            if value & ((1 << _CODE_BITS) - 1) == EXITED_CODE and value >> _CODE_BITS < seq:
                gone.append(peer)
        return gone

    def mark_exited(self) -> None:
        if self.mine is not None:
            self.mine[0] = (int(self.mine[0]) >> _CODE_BITS << _CODE_BITS) | EXITED_CODE

    def close(self) -> None:
        """Drop this rank's view of the board (local: never waits for a peer). Idempotent."""
        self._slots = []
        self.mine = None
        if self.mine_slot is not None:
            self.mine_slot.release()
            self.mine_slot = None
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # a view is still held somewhere: unmapped with its last reference
                pass


def _board_directory() -> str:
    """Node-local memory when there is such a file system (Linux), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _map_shared_board(node_comm: MPI.Comm) -> Optional[mmap.mmap]:
    """Collective over ``node_comm``: one 8-byte slot per node rank, mapped by every node rank.

    None on every node rank when any of them could not map it (the board then knows no peer).
    """
    node_rank, node_size = node_comm.Get_rank(), node_comm.Get_size()
    path, error = None, None
    if node_rank == 0:
        path = os.path.join(_board_directory(), f"commlib-board-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, _SLOT_BYTES * node_size)
            finally:
                os.close(fd)
        except OSError as exc:
            path, error = None, exc
    path = node_comm.bcast(path, root=0)
    mapping = None
    if path is not None:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mapping = mmap.mmap(fd, _SLOT_BYTES * node_size)
            finally:
                os.close(fd)
        except OSError as exc:
            error = exc
    everyone_mapped = node_comm.allreduce(mapping is not None, op=MPI.LAND)  # also: all have opened it
    if node_rank == 0 and path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
    if error is not None:
        sys.stderr.write(f"commlib: rank {MPI.COMM_WORLD.Get_rank()}: no shared progress board "
                         f"({error}); timeouts will not name the peers on this host\n")
    if not everyone_mapped and mapping is not None:
        mapping.close()
        mapping = None
    return mapping
