"""``bruck`` alltoall: ``ceil(log2 p)`` rounds at any ``p``, for small blocks.

Rank ``r`` first rotates its input into a scratch **table** so that row ``i`` holds its block for
rank ``r + i``. In round ``k`` (distance ``d = 2^k``) it packs the rows whose index has bit ``k``
set, sends them to ``r + d``, receives as many rows from ``r - d`` and unpacks them into the same
row indices. Invariant: a block in row ``i`` has travelled the distance of ``i``'s bits up to
``k``, so after the last round row ``i`` holds the block that rank ``r - i`` meant for ``r``;
the last step copies row ``i`` to ``out``'s block ``r - i``.

Cost (alpha-beta): ``ceil(log2 p)(alpha + n/2 beta)`` for ``n = p b`` elements, against the
pairwise exchange's ``(p-1)(alpha + b beta)``: fewer messages, about ``log2 p / 2`` times the
bytes, plus the local packing: the small-block alltoall. Extra memory: a table of ``n`` elements
and two packing buffers of ``ceil(p/2)`` blocks.
"""

from __future__ import annotations

__all__ = ["alltoall_bruck"]


def alltoall_bruck(transport, out, inp, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    block = inp.size // size
    if size == 1 or block == 0:
        transport.copy(out, inp)
        return
    table = transport.scratch(inp.size, inp.dtype, slot=1)
    transport.copy(table[:(size - rank) * block], inp[rank * block:])
    transport.copy(table[(size - rank) * block:], inp[:rank * block])
    rows = table.reshape(size, block)
    most = (size + 1) // 2
    packed = transport.scratch(most * block, inp.dtype, slot=2).reshape(most, block)
    unpacked = transport.scratch(most * block, inp.dtype, slot=3).reshape(most, block)
    distance = 1
    while distance < size:
        moving = [row for row in range(size) if row & distance]
        count = len(moving)
        packed[:count] = rows[moving]
        transport.step(f"bruck distance {distance}")
        transport.exchange(((packed[:count].reshape(-1), (rank + distance) % size),),
                           ((unpacked[:count].reshape(-1), (rank - distance) % size),))
        rows[moving] = unpacked[:count]
        distance *= 2
    sources = [(rank - row) % size for row in range(size)]
    out.reshape(size, block)[sources] = rows
