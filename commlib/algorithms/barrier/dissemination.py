"""``dissemination`` barrier: ``ceil(log2 p)`` rounds of one token out, one token in.

In round ``k`` (distance ``d = 2^k``) rank ``r`` sends a one-byte token to ``r + d`` and waits
for one from ``r - d``. Invariant: after round ``k``, rank ``r`` has heard, directly or through
others, from the ``2^(k+1) - 1`` ranks before it; after ``ceil(log2 p)`` rounds, from everyone,
so no rank leaves before all entered. Works at any ``p`` (unlike a butterfly).

Cost (alpha-beta): ``ceil(log2 p) alpha``; ``p ceil(log2 p)`` messages in all. Tokens are one
byte, not empty: NCCL skips empty transfers, which would make the barrier a no-op there.
"""

from __future__ import annotations

__all__ = ["barrier_dissemination"]


def barrier_dissemination(transport, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    if size == 1:
        return
    token_out = transport.scratch(1, "uint8", slot=1)
    token_in = transport.scratch(1, "uint8", slot=2)
    token_out[...] = 0  # what is sent is irrelevant, but sending uninitialised memory is not
    distance = 1
    while distance < size:
        transport.step(f"dissemination distance {distance}")
        transport.exchange((((token_out, (rank + distance) % size),)),
                           (((token_in, (rank - distance) % size),)))
        distance *= 2
