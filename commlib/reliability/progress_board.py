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
killed later leaves nothing behind (:mod:`commlib.shm.segments`).
"""

from __future__ import annotations

import os
import secrets
from typing import Dict, List, Optional, Tuple

import numpy as np

from commlib.shm.segments import map_host_files

__all__ = ["ProgressBoard", "COLLECTIVE_CODES", "CODE_BITS", "EXITED_CODE"]

COLLECTIVE_CODES = {"allreduce": 1, "broadcast": 2, "reduce": 3, "allgather": 4,
                    "reduce_scatter": 5, "barrier": 6, "new_group": 7, "alltoall": 8,
                    "alltoallv": 9, "alltoallv_counts": 10, "gather": 11, "scatter": 12}
EXITED_CODE = 255  # written at interpreter exit, so peers can tell "exited" from "slow"
_NAMES = {code: name for name, code in COLLECTIVE_CODES.items()}
CODE_BITS = 8
_SLOT_BYTES = 8


class ProgressBoard:
    def __init__(self, rendezvous, topology=None):
        """Collective over ``rendezvous`` (a :class:`commlib.rendezvous.interface.Rendezvous`)."""
        self.rank = rendezvous.rank
        self.size = rendezvous.size
        self.topology = topology
        self.key = ""
        self._exited = False
        if topology is not None and topology.spans_hosts:
            # Names this group to the witnesses of every host (and is what askers must know).
            self.key = rendezvous.broadcast(secrets.token_hex(8) if self.rank == 0 else None, root=0)
        host = rendezvous.host_local()
        try:
            on_host = host.allgather(self.rank)  # the group rank of each host rank
            node_ranks: List[Optional[int]] = [None] * self.size
            for node_rank, rank in enumerate(on_host):
                node_ranks[rank] = node_rank
            self._mapping, board_fd = _map_shared_board(host)
        finally:
            host.close()
        if board_fd is not None:
            try:
                if self.key and self._mapping is not None:
                    from commlib.reliability.crash_witness import register_board

                    register_board(self.key, self.rank, on_host.index(self.rank), board_fd)
            finally:
                os.close(board_fd)
        self._slots: List = []
        if self._mapping is not None:
            board = np.frombuffer(self._mapping, dtype=np.int64)
            self._slots = [None if node_rank is None else board[node_rank:node_rank + 1]
                           for node_rank in node_ranks]
            self.mine = self._slots[self.rank]
        else:  # no shared memory: this rank keeps its own slot, its peers are "unknown"
            self._slots = [None] * self.size
            self.mine = np.zeros(1, np.int64)
        self.mine[0] = 0
        # A memoryview store costs a third of a numpy item store; the hot path uses it.
        self.mine_slot: Optional[memoryview] = memoryview(self.mine)

    @staticmethod
    def encode(seq: int, collective: str) -> int:
        return (seq << CODE_BITS) | COLLECTIVE_CODES.get(collective, 0)

    def started(self, seq: int, collective: str) -> None:
        self.mine[0] = (seq << CODE_BITS) | COLLECTIVE_CODES.get(collective, 0)

    def last_started(self) -> Tuple[int, str]:
        """``(sequence number, collective)`` this rank last started, as its peers read it; ``(0,
        "nothing yet")`` before the first (tests use it to see which collective a call became)."""
        value = int(self.mine[0])
        return value >> CODE_BITS, _NAMES.get(value & ((1 << CODE_BITS) - 1), "nothing yet")

    def laggards(self, seq: int, collective: str) -> str:
        """Text naming the peers that have not started collective ``seq`` (or run another one).

        Peers on this host are read from the board; those on other hosts are asked of their
        hosts' crash witnesses (bounded: :data:`commlib.reliability.remote_progress.QUERY_SECONDS`).
        """
        behind, different, unknown = [], [], []
        remote, why_unknown = self._ask_remote_hosts()
        spans = self.topology is not None and self.topology.spans_hosts
        for peer, slot in enumerate(self._slots):
            if peer == self.rank:
                continue
            name = f"rank {peer} on host {self.topology.host_name_of(peer)}" if spans else f"rank {peer}"
            state = "alive"
            if slot is not None:
                value = int(slot[0])
            elif peer in remote and remote[peer].value >= 0:
                value, state = remote[peer]
            elif _witness_gone(why_unknown.get(self.topology.host_of(peer)) if spans else None):
                behind.append(f"{name} (every rank on its host has ended: its crash witness is gone)")
                continue
            else:
                unknown.append(peer)
                continue
            peer_seq, peer_code = value >> CODE_BITS, value & ((1 << CODE_BITS) - 1)
            peer_name = _NAMES.get(peer_code, "nothing yet")
            last = f"last started {peer_name} #{peer_seq}" if peer_seq else "started no collective yet"
            if state == "died":
                behind.append(f"{name} (its process died without a clean exit after starting "
                              f"{peer_name} #{peer_seq})" if peer_seq else f"{name} (its process died)")
            elif peer_code == EXITED_CODE or state == "bye":
                behind.append(f"{name} (its process exited after #{peer_seq})")
            elif state == "abort":
                behind.append(f"{name} (its process aborted the job; {last})")
            elif peer_seq < seq:
                behind.append(f"{name} ({last})")
            elif peer_seq == seq and peer_name != collective:
                different.append(f"{name} (called {peer_name} #{peer_seq} instead)")
            elif peer_seq > seq:
                different.append(f"{name} (already at {peer_name} #{peer_seq})")
        parts = []
        if behind:
            parts.append("never heard from " + ", ".join(behind))
        if different:
            parts.append("out of step: " + ", ".join(different))
        if unknown:
            parts.append(self._describe_unknown(unknown, why_unknown))
        if not parts:
            where = "peer" if spans else "on-node peer"
            return f"every {where} entered this collective (one of them may be stuck in it)"
        return "; ".join(parts)

    def exited_before(self, seq: int) -> List[int]:
        """On-node peers whose process exited before starting collective ``seq`` (it can never
        complete with them). One that exited after starting it may have done its part."""
        gone = []
        for peer, slot in enumerate(self._slots):
            if slot is None or peer == self.rank:
                continue
            value = int(slot[0])
            if value & ((1 << CODE_BITS) - 1) == EXITED_CODE and value >> CODE_BITS < seq:
                gone.append(peer)
        return gone

    def exited_peers(self) -> List[int]:
        """On-node peers whose process exited (cleanly, through the interpreter's exit)."""
        return [peer for peer, slot in enumerate(self._slots)
                if slot is not None and peer != self.rank
                and int(slot[0]) & ((1 << CODE_BITS) - 1) == EXITED_CODE]

    def _ask_remote_hosts(self):
        """Board values of the ranks on other hosts, from their witnesses; (states, why-not by host)."""
        topology = self.topology
        if topology is None or not topology.spans_hosts:
            return {}, {}
        ranks_by_host: Dict[int, List[int]] = {}
        for peer, slot in enumerate(self._slots):
            if slot is None and peer != self.rank:
                ranks_by_host.setdefault(topology.host_of(peer), []).append(peer)
        if not ranks_by_host:
            return {}, {}
        endpoints = dict(enumerate(topology.witness_endpoints))
        if not self.key or not endpoints:
            return {}, dict.fromkeys(ranks_by_host, "no crash witness (COMMLIB_CRASH_WITNESS=0?)")
        from commlib.reliability.remote_progress import ask_hosts

        states, failures = ask_hosts(self.key, endpoints, ranks_by_host)
        for host, ranks in ranks_by_host.items():
            if host not in failures and any(states.get(r, (-1, ""))[0] < 0 for r in ranks):
                failures[host] = "its crash witness does not know this group's ranks there"
        return states, failures

    def _describe_unknown(self, unknown, why_unknown) -> str:
        topology = self.topology
        if topology is None or not topology.spans_hosts:
            return f"state unknown for off-node rank(s) {', '.join(map(str, unknown))}"
        by_host: Dict[int, List[int]] = {}
        for peer in unknown:
            by_host.setdefault(topology.host_of(peer), []).append(peer)
        return "; ".join(
            f"state unknown for rank(s) {', '.join(map(str, ranks))} on host {topology.host_names[host]} "
            f"({why_unknown.get(host, 'no board')})"
            for host, ranks in by_host.items())

    def mark_exited(self) -> None:
        self._exited = True
        if self.mine is not None:
            self.mine[0] = (int(self.mine[0]) >> CODE_BITS << CODE_BITS) | EXITED_CODE

    def close(self) -> None:
        """Drop this rank's view of the board (local: never waits for a peer). Idempotent."""
        if self.key and not self._exited:  # at exit the witness keeps showing "exited"
            from commlib.reliability.crash_witness import unregister_board

            unregister_board(self.key)
        self.key = ""
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


def _witness_gone(why) -> bool:
    """The witness's port refused the connection: it has exited, after the last rank of its host."""
    return why is not None and "refused" in why.lower()


def _map_shared_board(host):
    """Collective over ``host`` (this host's ranks): one 8-byte slot per host rank, in one file of
    the first.

    Returns ``(mapping, fd)``: ``fd`` (the caller closes it) lets the crash witness map the board
    too. The mapping is None on every node rank when any of them could not map it (the board
    then knows no peer).
    """
    files = map_host_files(host, _SLOT_BYTES * host.size if host.rank == 0 else 0,
                           kind="board", peers_writable=True, keep_fds=True)
    if files is None:
        return None, None
    assert files.fds is not None  # keep_fds
    return files.mappings[0], files.fds[0]
