"""``tree``: pipelined binary-tree reduce to rank 0, then pipelined broadcast back.

Ranks form a binary heap: rank ``r`` has children ``2r + 1`` and ``2r + 2`` and parent
``(r - 1) // 2``; the depth is ``floor(log2 p)``. The buffer is cut into **segments** that flow
through the tree one after another, so every level works on a different segment at once.

* Reduce: for each segment, a rank receives its children's partial results (into scratch, the
  next segments' receives already posted), combines them into its own buffer in a fixed order
  (own, left child, right child) and sends the sum to its parent. Invariant: a rank's segment,
  once sent up, holds the reduction over its subtree; rank 0 ends with the total.
* Broadcast: each segment travels down, received straight into the buffer and forwarded to the
  children. Every rank ends with rank 0's bytes.

Cost (alpha-beta) with ``S`` segments of ``n/S`` elements: each phase takes about
``(depth + S) (alpha + 2 n/S beta)`` (an inner rank sends to two children), so the latency grows
with ``log2 p`` instead of ``p`` (ring) while the bandwidth term stays ``O(n)``; it does not
overlap the two phases as NCCL's double binary tree does. Extra memory: two scratch segments
(one per child) per segment in flight.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, List, Tuple

from commlib.algorithms.common.forward import drain, forward_segments
from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import PIPELINE_WINDOW, scratch_slots
from commlib.ops import ReduceOp
from commlib.transports.interface import Pending

__all__ = ["allreduce_tree", "tree_links"]


def tree_links(rank: int, size: int):
    """``(parent or -1, [children])`` of ``rank`` in the binary heap over ``size`` ranks."""
    parent = (rank - 1) // 2 if rank > 0 else -1
    children = [child for child in (2 * rank + 1, 2 * rank + 2) if child < size]
    return parent, children


def allreduce_tree(transport, buf, op: ReduceOp, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    if size == 1 or buf.size == 0:
        return
    parent, children = tree_links(rank, size)
    segment_elems = segment_elements(segment_bytes, buf.itemsize)
    segments = split_bounds(0, buf.size, segment_count(buf.size, segment_elems))
    window = PIPELINE_WINDOW
    _reduce_up(transport, buf, op, segments, parent, children, window)
    forward_segments(transport, buf, segments, parent, children, window, "tree broadcast")


def _reduce_up(transport, buf, op, segments, parent, children, window) -> None:
    count = len(segments)
    step, post, reduce = transport.step, transport.post, transport.reduce
    slots = []
    if children:
        longest = segments[0][1] - segments[0][0]
        slots = scratch_slots(transport, longest, buf.dtype, window=2 * (window + 1) - 1)
    incoming: Deque[Tuple[Pending, List[Tuple[Any, int]]]] = collections.deque()  # (receives, where they land)
    outgoing: Deque[Pending] = collections.deque()
    posted = 0
    for index, (lo, hi) in enumerate(segments):
        step(f"tree reduce segment {index}")
        if children:
            while posted < min(count, index + 1 + window):
                p_lo, p_hi = segments[posted]
                base = (posted % (window + 1)) * 2
                recvs = [(slots[base + which][:p_hi - p_lo], child) for which, child in enumerate(children)]
                incoming.append((post((), recvs), recvs))
                posted += 1
            pending, recvs = incoming.popleft()
            pending.wait()
            for received, _child in recvs:
                reduce(buf[lo:hi], received, op, False)
        if parent >= 0:
            outgoing.append(post(((buf[lo:hi], parent),), ()))
            drain(outgoing, window)
    step("tree reduce")
    drain(outgoing, 0)
