"""``bruck`` allgather: ``ceil(log2 p)`` rounds at any ``p``, blocks gathered at distance ``2^k``.

In round ``k`` (distance ``d = 2^k``) rank ``r`` sends the ``c = min(d, p - d)`` blocks it holds
starting at its own, ``r .. r + c - 1`` (mod ``p``), to ``r - d``, and receives blocks ``r + d ..
r + d + c - 1`` from ``r + d``. Invariant: after round ``k`` rank ``r`` holds blocks ``r .. r +
2^(k+1) - 1`` (mod ``p``), so after ``ceil(log2 p)`` rounds it holds all ``p``. Blocks are kept
at their final places in ``out``: a range that wraps past block ``p - 1`` travels as two slices,
and since the sender's range is the receiver's, both cut it at the same block.

Cost (alpha-beta): ``ceil(log2 p) alpha + n (p-1)/p beta`` for an output of ``n`` elements at
any ``p`` (recursive doubling needs a power of two for that): the small-message allgather. No
extra memory (the textbook version rotates a scratch copy at the end; keeping blocks in place
avoids it).
"""

from __future__ import annotations

__all__ = ["allgather_bruck"]


def allgather_bruck(transport, out, inp, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    block = inp.size
    transport.copy(out[rank * block:(rank + 1) * block], inp)
    if size == 1 or block == 0:
        return

    def wrapped(first: int, count: int):
        """Blocks ``first .. first + count - 1`` (mod p) of ``out`` as one or two slices."""
        first %= size
        end = first + count
        if end <= size:
            return [out[first * block:end * block]]
        return [out[first * block:], out[:(end - size) * block]]

    distance = 1
    while distance < size:
        count = min(distance, size - distance)
        destination, source = (rank - distance) % size, (rank + distance) % size
        transport.step(f"bruck distance {distance}")
        transport.exchange([(piece, destination) for piece in wrapped(rank, count)],
                           [(piece, source) for piece in wrapped(rank + distance, count)])
        distance *= 2
