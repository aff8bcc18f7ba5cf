"""Catch-up from a live peer: a member behind the others gets their state over the new group.

Collective over a freshly built cross-replica group, right after a quorum forms. The members
first allgather how many steps each has committed; if they all agree nothing moves (the normal
case: one allgather of 8 bytes each). Otherwise the lowest rank among the most advanced ones is
the *source*: it broadcasts a header (its ledger as JSON: the data position and the history,
and the payload's length); the payload (the registered states, encoded by the manager's codec)
goes point to point down a chain of the members that are behind, source first, in chunks that
each member passes on as soon as it has them; last, the source broadcasts the payload's
SHA-256. A receiver checks length and checksum before it loads anything. The members that were
not behind move no payload byte and keep their state.

The transfer is a pipeline, so that a catch-up costs the wire time and little more: every link
of the chain carries the bytes once, whatever the number of members (a broadcast's tree would
send them once per subtree from the source: twice the wire time with three members on 1 Gbit/s
links); two chunks are in flight while the source hashes the one it sends and a receiver the
one it just got (``hashlib`` and the sockets run without the GIL); and nobody copies the whole
payload: the source sends from the codec's buffer, a receiver loads from the buffer it
received into.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Callable, Optional, Tuple, Union

import numpy as np

from commlib.errors import CommError

__all__ = ["CHUNK_BYTES", "CatchUp", "Payload", "broadcast_small", "catch_up"]

Payload = Union[bytes, bytearray, memoryview]

# Large enough that a chunk's message overhead (tens of microseconds over sockets) is noise
# beside its wire time, small enough that the last chunk's hash, which nothing overlaps,
# is a few milliseconds.
CHUNK_BYTES = 8 << 20
# The payload's point-to-point tag on the group (the manager's own: no user message meets it).
CATCH_UP_TAG = 1


class CatchUp:
    """What a catch-up did: who sent, how many bytes, how long it took (0 bytes: nobody was behind).
    ``seconds`` counts from the call (waiting for the slowest member included); ``transfer_seconds``
    from the moment every member was there to the state loaded."""

    def __init__(self, source: int, behind: list, nbytes: int, seconds: float, transfer_seconds: float = 0.0):
        self.source, self.behind, self.nbytes = source, behind, nbytes
        self.seconds, self.transfer_seconds = seconds, transfer_seconds

    def __repr__(self) -> str:
        return (f"CatchUp(source={self.source}, behind={self.behind}, {self.nbytes} B in {self.transfer_seconds:.3f} s "
                f"of {self.seconds:.3f} s)")


def broadcast_small(group, data: Optional[bytes], root: int) -> bytes:
    """``root``'s ``data`` (a few bytes: a header, a record) on every rank of ``group``: its length, then the bytes."""
    length = np.array([len(data) if data is not None else 0], np.int64)
    group.broadcast(length, root=root)
    buffer = np.empty(int(length[0]), np.uint8)
    if group.rank == root and data is not None:
        buffer[:] = np.frombuffer(data, np.uint8)
    if buffer.size:
        group.broadcast(buffer, root=root)
    return buffer.tobytes()


def _send_payload(group, payload: Payload, first: int, chunk_sent: Optional[Callable[[int], None]]) -> bytes:
    """The source's side: chunks to ``first``, the head of the chain; returns the SHA-256."""
    data = np.frombuffer(payload, np.uint8)
    staging = None
    if not data.flags.writeable:  # our sends take writable buffers: stage chunks (two in flight)
        staging = [np.empty(min(CHUNK_BYTES, data.size), np.uint8) for _ in range(2)]
    digest = hashlib.sha256()
    in_flight = None
    for index, start in enumerate(range(0, data.size, CHUNK_BYTES)):
        chunk = data[start:start + CHUNK_BYTES]
        if staging is not None:
            staged = staging[index % 2][:chunk.size]
            staged[:] = chunk  # the buffer of chunk index - 2, whose send has completed
            chunk = staged
        work = group.isend(chunk, first, CATCH_UP_TAG)
        digest.update(chunk.data)  # while it and the chunk before it are on the wire
        if in_flight is not None:
            in_flight.wait()
        in_flight = work
        if chunk_sent is not None:
            chunk_sent(index)
    if in_flight is not None:
        in_flight.wait()
    return digest.digest()


def _relay_payload(group, nbytes: int, previous: int, following: Optional[int]) -> Tuple[np.ndarray, bytes]:
    """A member behind: receive the chunks from ``previous`` and pass each on to ``following``
    (the next member behind, if any) as soon as it is here; returns (the payload, its SHA-256)."""
    payload = np.empty(nbytes, np.uint8)
    chunks = [payload[start:start + CHUNK_BYTES] for start in range(0, nbytes, CHUNK_BYTES)]
    digest = hashlib.sha256()
    receives = [group.irecv(chunk, previous, CATCH_UP_TAG) for chunk in chunks[:2]]
    sends: list = []
    for index, chunk in enumerate(chunks):
        receives[index].wait()
        if index + 2 < len(chunks):  # keep two receives posted: the kernel's buffers stay full
            receives.append(group.irecv(chunks[index + 2], previous, CATCH_UP_TAG))
        if following is not None:
            sends.append(group.isend(chunk, following, CATCH_UP_TAG))
            if len(sends) > 2:
                sends.pop(0).wait()
        digest.update(chunk.data)  # while the next chunk arrives (and this one is passed on)
    for work in sends:
        work.wait()
    return payload, digest.digest()


def catch_up(group, steps: int, save: Callable[[], Tuple[dict, Payload]],
             load: Callable[[dict, Payload], None], *, chunk_sent: Optional[Callable[[int], None]] = None) -> CatchUp:
    """Bring every member of ``group`` to the most advanced member's state (see the module
    docstring). ``save()`` gives (ledger JSON, payload) on the source, the payload any bytes-like
    object (sent from in place when writable); ``load(ledger, payload)`` installs them on a
    member that was behind (the payload a memoryview of the received bytes). ``chunk_sent(index)``
    is called on the source once it has put chunk ``index`` on the wire."""
    started = time.perf_counter()
    mine = np.array([steps], np.int64)
    everyone = np.empty(group.size, np.int64)
    group.allgather(everyone, mine)
    transfer_started = time.perf_counter()
    most = int(everyone.max())
    behind = [rank for rank in range(group.size) if everyone[rank] < most]
    if not behind:
        return CatchUp(-1, [], 0, time.perf_counter() - started)
    source = int(np.flatnonzero(everyone == most)[0])
    header = payload = None
    if group.rank == source:
        ledger, payload = save()
        header = json.dumps({"ledger": ledger, "bytes": memoryview(payload).nbytes}).encode()
    meta = json.loads(broadcast_small(group, header, source))
    nbytes = int(meta["bytes"])
    chain = [source] + behind  # the bytes go down it once, chunk by chunk; the others wait for the digest
    position = chain.index(group.rank) if group.rank in chain else -1
    received = None
    digest = b""
    if position == 0:
        assert payload is not None
        digest = _send_payload(group, payload, chain[1], chunk_sent)
    elif position > 0:
        following = chain[position + 1] if position + 1 < len(chain) else None
        received, digest = _relay_payload(group, nbytes, chain[position - 1], following)
    expected = np.frombuffer(bytearray(digest), np.uint8) if group.rank == source else np.empty(32, np.uint8)
    group.broadcast(expected, root=source)
    if received is not None:
        if received.size != nbytes or digest != expected.tobytes():
            raise CommError(f"catch-up on rank {group.rank} of {group.name!r}: the state from rank {source} has "
                            f"{received.size} bytes, SHA-256 {digest.hex()[:16]}..., but the source says {nbytes} "
                            f"bytes, {expected.tobytes().hex()[:16]}...")
        load(meta["ledger"], received.data)
    now = time.perf_counter()
    return CatchUp(source, behind, nbytes, now - started, now - transfer_started)
