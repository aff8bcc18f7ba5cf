"""``shm_oneshot``: every rank reads every rank's contribution and reduces it itself (small messages).

Needs a transport with direct access to its peers' memory (the ranks of one host, see
:mod:`commlib.transports.shm`). Terms: a **slot** is a rank's small-message area in its own
shared segment (two per rank, used by alternate collectives); a **round** is one pass over at
most a slot's worth of the buffer (a larger buffer is reduced round by round, each round a
collective of its own: its own epoch).

One round: each rank copies its piece of the buffer into its slot and signals it (a signature
naming dtype, op and the collective's size, a fence where the copy needs one, the epoch); once
every rank's signal shows the round with the same signature, each rank reads the ``P`` slots in
rank order and combines them straight into its own buffer, ``((x_0 op x_1) op x_2) ...``. The
round runs as one closure built by the transport (``transport.slot_round``), which is also the
small allreduce's fast path: at 8 bytes the whole allreduce has a budget of about a microsecond
of Python. Invariant: every rank evaluates the very same expression on the very same bytes, so
every rank ends with the same bits, whatever the dtype. A slot is written again two rounds
later, when every peer has arrived at the round in between, i.e. finished reading it, so nobody
waits for a slow reader.

Cost, per round of ``n`` bytes: one synchronisation (a cache line crossing cores, well under a
microsecond when the ranks are in step) and no message: ``n`` bytes copied, ``(P - 1) n`` read
from peers, ``P - 1`` element-wise passes. Latency-optimal; it reads ``P/2`` times more than
``shm_twoshot``, hence small messages. The user's buffer is never visible to peers, so it may
live anywhere (symmetric or not).
"""

from __future__ import annotations

from commlib.algorithms.common.partition import rounds_last_first
from commlib.errors import InvalidUsageError
from commlib.ops import ReduceOp

__all__ = ["allreduce_shm_oneshot"]


def allreduce_shm_oneshot(transport, buf, op: ReduceOp, *, segment_bytes: int = 0) -> None:
    if transport.size == 1 or buf.size == 0:
        return
    slot_round = transport.slot_round
    round_elems = transport.layout.slot_bytes // buf.itemsize
    if buf.size <= round_elems:
        pieces = [(buf, None)]
    else:  # last round first, as shm_twoshot's (its end is what is still in cache): ~5% faster
        # at 8 MiB, the same either way at 512 KiB-2 MiB
        pieces = [(buf[start:stop], buf.nbytes) for start, stop in rounds_last_first(buf.size, round_elems)]
    for piece, total_bytes in pieces:
        if not slot_round(0, None, piece, op, total_bytes):
            raise InvalidUsageError(f"allreduce: shm_oneshot cannot reduce this buffer ({piece.dtype}, op "
                                    f"{op!r}, {'contiguous' if piece.flags.c_contiguous else 'not contiguous'}, "
                                    f"{'writable' if piece.flags.writeable else 'read-only'})")


# The registry's flags are function attributes (see algorithms/__init__.py), which mypy cannot type.
allreduce_shm_oneshot.requires_shared_memory = True  # type: ignore[attr-defined]
allreduce_shm_oneshot.folds_average = True  # type: ignore[attr-defined]
