"""``scatter_allgather`` broadcast (van de Geijn): scatter the buffer, then allgather it.

The buffer is cut into ``p`` **chunks**, chunk ``v`` belonging to relative rank ``v`` (see
:mod:`.binomial`).

* Scatter, down the binomial tree: a rank receives from its parent the chunks of its whole
  subtree, ``[v, subtree end)``, straight into the buffer, and sends each child the chunks of
  the child's subtree. Invariant: afterwards every rank holds the chunks of its subtree.
* Allgather, around the ring of relative ranks, ``p - 1`` steps: at step ``t`` rank ``v`` sends
  chunk ``v - t`` to ``v + 1`` and receives chunk ``v - t - 1`` from ``v - 1``, except chunks the
  receiver already holds from the scatter (so the root receives nothing). Invariant: a rank
  sends at step ``t`` the chunk it received at step ``t - 1`` (or held already).

Cost (alpha-beta): ``(ceil(log2 p) + p - 1) alpha + 2 n (p-1)/p beta``: every rank receives
exactly ``n`` elements and no rank sends more than about ``1.5 n``, against the binomial tree's
``n log2 p`` from the root: the large-message broadcast when ``p`` is small enough for the
ring's ``p - 1`` latencies. No extra memory.
"""

from __future__ import annotations

from commlib.algorithms.common.binomial import binomial_children, binomial_parent, real_rank, relative_rank, subtree_end
from commlib.algorithms.common.partition import split_bounds

__all__ = ["broadcast_scatter_allgather"]


def broadcast_scatter_allgather(transport, buf, root: int, *, segment_bytes: int = 1 << 20) -> None:
    size = transport.size
    if size == 1 or buf.size == 0:
        return
    relative = relative_rank(transport.rank, root, size)
    chunks = split_bounds(0, buf.size, size)

    def chunk_range(first: int, end: int):
        return buf[chunks[first][0]:chunks[end - 1][1]]

    own_end = subtree_end(relative, size)
    parent = binomial_parent(relative, size)
    if parent >= 0:
        transport.step("scatter: receive subtree chunks")
        transport.recv(chunk_range(relative, own_end), real_rank(parent, root, size))
    children = binomial_children(relative, size)
    if children:
        transport.step("scatter: send subtree chunks")
        transport.exchange(sends=[(chunk_range(child, end), real_rank(child, root, size))
                                  for child, end in children])

    right, left = (relative + 1) % size, (relative - 1) % size
    right_holds = range(right, subtree_end(right, size))  # what the scatter gave the right neighbour
    right_real, left_real = real_rank(right, root, size), real_rank(left, root, size)
    for step in range(size - 1):
        send_chunk, recv_chunk = (relative - step) % size, (relative - step - 1) % size
        send_lo, send_hi = chunks[send_chunk]
        recv_lo, recv_hi = chunks[recv_chunk]
        sends = (((buf[send_lo:send_hi], right_real),)
                 if send_hi > send_lo and send_chunk not in right_holds else ())
        recvs = (((buf[recv_lo:recv_hi], left_real),)
                 if recv_hi > recv_lo and not relative <= recv_chunk < own_end else ())
        transport.step(f"ring allgather step {step}")
        transport.exchange(sends, recvs)
