"""``recursive_doubling`` allgather: ``log2 p`` exchanges whose size doubles each round.

With ``p = 2^k + rem``, the first ``2 rem`` ranks pair up: even ``2i`` sends its block to
``2i + 1``, which takes part as **virtual rank** ``i`` holding the two blocks ``2i, 2i + 1``;
rank ``r >= 2 rem`` is virtual rank ``r - rem`` holding block ``r``. Virtual ranks hold
consecutive, contiguous ranges of ``out``, so any aligned group of them holds one contiguous
range. In round ``m = 1, 2, 4, ...`` virtual rank ``v`` exchanges its group's range with
``v xor m``, received straight into ``out``. Invariant: after round ``m``, ``v`` holds the range
of its aligned group of ``2m`` virtual ranks. Finally each ``2i + 1`` sends all of ``out`` to
``2i``.

Cost (alpha-beta): ``log2 p (alpha) + n (p-1)/p beta`` for an output of ``n`` elements when ``p``
is a power of two (latency-optimal and bandwidth-optimal); otherwise two more steps, of ``n/p``
and ``n`` elements, on the folded pairs. No extra memory.
"""

from __future__ import annotations

__all__ = ["allgather_recursive_doubling"]


def allgather_recursive_doubling(transport, out, inp, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    block = inp.size
    transport.copy(out[rank * block:(rank + 1) * block], inp)
    if size == 1 or block == 0:
        return
    power = 1 << (size.bit_length() - 1)
    remainder = size - power
    if rank < 2 * remainder:
        transport.step("fold-in")
        if rank % 2 == 0:
            transport.send(inp, rank + 1)
            transport.step("fold-out")
            transport.recv(out, rank + 1)
            return
        transport.recv(out[(rank - 1) * block:rank * block], rank - 1)
    virtual = rank // 2 if rank < 2 * remainder else rank - remainder

    def first_block(virtual_rank: int) -> int:
        return 2 * virtual_rank if virtual_rank < remainder else virtual_rank + remainder

    def group_range(virtual_rank: int, distance: int):
        first = (virtual_rank // distance) * distance
        return out[first_block(first) * block:first_block(first + distance) * block]

    distance = 1
    while distance < power:
        partner = virtual ^ distance
        real_partner = 2 * partner + 1 if partner < remainder else partner + remainder
        transport.step(f"recursive doubling distance {distance}")
        transport.exchange(((group_range(virtual, distance), real_partner),),
                           ((group_range(partner, distance), real_partner),))
        distance *= 2
    if rank < 2 * remainder:
        transport.step("fold-out")
        transport.send(out, rank - 1)
