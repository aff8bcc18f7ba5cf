"""``flat`` broadcast: the root sends the whole buffer to every other rank in one step.

Every non-root rank receives straight from the root; the root posts its ``p - 1`` sends at once.
Invariant: a rank's buffer is written only by its one receive from the root.

Cost (alpha-beta): ``alpha + (p - 1) n beta`` if the root's link serialises the sends, which is
why trees win across a network. On one host over shared memory it is the other way round: the
library copies a large message on the *receiving* side (a single-copy read of the sender's
memory, CMA/XPMEM), so the ``p - 1`` receivers copy at once, one per core, and the critical path
is one copy of ``n`` per core instead of the binomial tree's ``ceil(log2 p)`` copies in a row
(faster than ``MPI_Bcast`` and the binomial tree from a few MiB at 4 ranks:
docs/benchmarks/collectives-broadcast-p4). No extra memory.
"""

from __future__ import annotations

__all__ = ["broadcast_flat"]


def broadcast_flat(transport, buf, root: int, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    if size == 1 or buf.size == 0:
        return
    transport.step("flat broadcast")
    if rank == root:
        transport.exchange(sends=[(buf, peer) for peer in range(size) if peer != root])
    else:
        transport.recv(buf, root)
