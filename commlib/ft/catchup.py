"""Catch-up from a live peer: a member behind the others gets their state over the new group.

Collective over a freshly built cross-replica group, right after a quorum forms. The members
first allgather how many steps each has committed; if they all agree nothing moves (the normal
case: one allgather of 8 bytes each). Otherwise the lowest rank among the most advanced ones is
the *source*: it broadcasts a header (its ledger as JSON: the data position and the history,
the payload's length and SHA-256) and the payload (the registered states, encoded by the
manager's codec). A receiver checks length and checksum before it loads anything; the members
that were not behind receive the bytes too (the broadcast reaches every rank) but keep theirs.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Callable, Optional, Tuple

import numpy as np

from commlib.errors import CommError

__all__ = ["CatchUp", "catch_up"]


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


def _broadcast_bytes(group, data: Optional[bytes], root: int) -> bytes:
    length = np.array([len(data) if data is not None else 0], np.int64)
    group.broadcast(length, root=root)
    buffer = np.empty(int(length[0]), np.uint8)
    if group.rank == root and data is not None:
        buffer[:] = np.frombuffer(data, np.uint8)
    if buffer.size:
        group.broadcast(buffer, root=root)
    return buffer.tobytes()


def catch_up(group, steps: int, save: Callable[[], Tuple[dict, bytes]],
             load: Callable[[dict, bytes], None]) -> CatchUp:
    """Bring every member of ``group`` to the most advanced member's state (see the module
    docstring). ``save()`` gives (ledger JSON, payload) on the source; ``load(ledger, payload)``
    installs them on a member that was behind."""
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
        header = json.dumps({"ledger": ledger, "bytes": len(payload),
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    header_bytes = _broadcast_bytes(group, header, source)
    received = _broadcast_bytes(group, payload, source)
    if group.rank in behind:
        meta = json.loads(header_bytes)
        digest = hashlib.sha256(received).hexdigest()
        if len(received) != meta["bytes"] or digest != meta["sha256"]:
            raise CommError(f"catch-up on rank {group.rank} of {group.name!r}: the state from rank {source} has "
                            f"{len(received)} bytes, SHA-256 {digest[:16]}..., but its header says {meta['bytes']} "
                            f"bytes, {meta['sha256'][:16]}...")
        load(meta["ledger"], received)
    now = time.perf_counter()
    return CatchUp(source, behind, len(received), now - started, now - transfer_started)
