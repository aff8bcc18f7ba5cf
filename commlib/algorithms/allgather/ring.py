"""``ring`` allgather: every block travels once around the ring.

``out`` holds one **block** per rank, rank-major; rank ``r`` sends only to ``r + 1`` and
receives only from ``r - 1``. Rank ``r`` first copies its input into block ``r``; at step ``t =
0 .. p-2`` it sends block ``r - t`` and receives block ``r - t - 1`` straight into ``out``.
Invariant: after step ``t``, rank ``r`` holds blocks ``r - t - 1 .. r``; the block it sends at
step ``t`` is the one it received at step ``t - 1``.

Cost (alpha-beta): ``(p-1)(alpha + n/p beta)`` for an output of ``n`` elements: bandwidth-optimal
(every rank receives exactly the ``n (p-1)/p`` it lacks), latency linear in ``p``. Whole blocks
per step: with nothing to reduce there is nothing for segments to overlap. No extra memory.
"""

from __future__ import annotations

__all__ = ["allgather_ring"]


def allgather_ring(transport, out, inp, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    block = inp.size
    transport.copy(out[rank * block:(rank + 1) * block], inp)
    if size == 1 or block == 0:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_block, recv_block = (rank - step) % size, (rank - step - 1) % size
        transport.step(f"ring allgather step {step}")
        transport.exchange(((out[send_block * block:(send_block + 1) * block], right),),
                           ((out[recv_block * block:(recv_block + 1) * block], left),))
