"""``binomial`` reduce: partial results flow up a binomial tree to the root, segment by segment.

Ranks are numbered relative to the root (see :mod:`.binomial`); the buffer is cut into
**segments**. For each segment a rank combines its own operand with its children's partial
results, the children in increasing relative rank (own, ``v+1``, ``v+2``, ``v+4``, ...: the
operands in relative-rank order), and sends the **partial** up to its parent. Invariant: the
partial a rank sends holds the reduction over its subtree; the root's is the result. The root
reduces straight into its buffer; every other rank's buffer is input only, so an inner rank
builds its partials in scratch (the first child's segment is received into the partial and then
combined with the rank's own; leaves send their buffer). Up to ``window`` later segments are in
flight while one is reduced.

Cost (alpha-beta), ``S`` segments: about ``(ceil(log2 p) + S)(alpha + n/S beta)`` on the
critical path, but the root receives ``ceil(log2 p)`` full buffers: latency-optimal for small
messages, where rabenseifner's reduce wins for large ones. Extra memory on an inner rank: ``2w +
1`` partial segments and ``w + 1`` receive segments per further child (``w`` the window).
"""

from __future__ import annotations

import collections
from typing import Deque

from commlib.algorithms.common.binomial import binomial_children, binomial_parent, real_rank, relative_rank
from commlib.algorithms.common.forward import drain
from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import PIPELINE_WINDOW, scratch_slots
from commlib.ops import ReduceOp
from commlib.transports.interface import Pending

__all__ = ["reduce_binomial"]


def reduce_binomial(transport, buf, root: int, op: ReduceOp, *, segment_bytes: int = 1 << 20) -> None:
    size = transport.size
    if size == 1 or buf.size == 0:
        return
    relative = relative_rank(transport.rank, root, size)
    parent_relative = binomial_parent(relative, size)
    parent = real_rank(parent_relative, root, size) if parent_relative >= 0 else -1
    # Combined in increasing relative rank: the operands' order is the same whoever computes.
    children = [real_rank(child, root, size) for child, _ in reversed(binomial_children(relative, size))]
    segment_elems = segment_elements(segment_bytes, buf.itemsize)
    segments = split_bounds(0, buf.size, segment_count(buf.size, segment_elems))
    window = PIPELINE_WINDOW
    step, post, reduce = transport.step, transport.post, transport.reduce
    if not children:  # a leaf sends its own segments
        outgoing: Deque[Pending] = collections.deque()
        for index, (lo, hi) in enumerate(segments):
            step(f"binomial reduce segment {index}")
            outgoing.append(post(((buf[lo:hi], parent),), ()))
            drain(outgoing, window)
        step("binomial reduce")
        drain(outgoing, 0)
        return
    longest = segments[0][1] - segments[0][0]
    in_place = parent < 0
    # A partial slot is reused 2w + 1 segments later: by then its send completed, since at most
    # w sends stay in flight and receives are posted at most w segments ahead.
    partials = [] if in_place else scratch_slots(transport, longest, buf.dtype, window=2 * window, scratch_slot=1)
    extra_children = len(children) - 1 if not in_place else len(children)
    receive_slots = (scratch_slots(transport, longest, buf.dtype, window=(window + 1) * extra_children - 1,
                                   scratch_slot=2)
                     if extra_children else [])

    def targets(index: int):
        """Where segment ``index`` is reduced and where each child's operand lands."""
        lo, hi = segments[index]
        if in_place:
            landing = [receive_slots[(index % (window + 1)) * extra_children + which][:hi - lo]
                       for which in range(len(children))]
            return buf[lo:hi], landing
        partial = partials[index % len(partials)][:hi - lo]
        landing = [partial] + [receive_slots[(index % (window + 1)) * extra_children + which][:hi - lo]
                               for which in range(extra_children)]
        return partial, landing

    incoming: Deque[Pending] = collections.deque()
    outgoing = collections.deque()
    posted = 0
    for index, (lo, hi) in enumerate(segments):
        step(f"binomial reduce segment {index}")
        while posted < min(len(segments), index + 1 + window):
            _, landing = targets(posted)
            incoming.append(post((), list(zip(landing, children))))
            posted += 1
        incoming.popleft().wait()
        result, landing = targets(index)
        if in_place:
            for received in landing:
                reduce(result, received, op, False)
        else:
            reduce(result, buf[lo:hi], op, True)  # own operand first
            for received in landing[1:]:
                reduce(result, received, op, False)
            outgoing.append(post(((result, parent),), ()))
            drain(outgoing, window)
    step("binomial reduce")
    drain(outgoing, 0)
