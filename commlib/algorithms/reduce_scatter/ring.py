"""``ring`` reduce_scatter: partial sums travel around the ring, growing by one rank per step.

``inp`` holds one **chunk** per rank (``out.size`` elements each), every chunk cut into the same
number of **segments**. Rank ``r`` sends only to ``r + 1`` and receives only from ``r - 1``. At
step ``s = 0 .. p-2`` it sends the **partial** of chunk ``r - s - 1`` (at step 0, its own input
chunk) and receives the partial of chunk ``r - s - 2``, which it combines with its own input
chunk into the partial it sends next step. Invariant: the partial of a chunk received at step
``s`` holds the reduction over the ``s + 1`` ranks before the receiver; at the last step rank
``r`` receives chunk ``r`` reduced over the other ``p - 1`` ranks and adds its own into ``out``.
``inp`` is never written: partials alternate between two chunk-sized scratch buffers (a partial
is sent while the next one arrives).

Cost (alpha-beta): ``(p-1)(alpha + n/p beta + n/p gamma)`` for an input of ``n`` elements:
bandwidth-optimal, latency linear in ``p``. Segments pipeline the steps: segment ``k`` of step
``s + 1`` leaves as soon as segment ``k`` of step ``s`` was combined. Extra memory: two chunks.
"""

from __future__ import annotations

from typing import Any

from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import PIPELINE_WINDOW, Stage, run_stages
from commlib.ops import ReduceOp

__all__ = ["reduce_scatter_ring"]


def reduce_scatter_ring(transport, out, inp, op: ReduceOp, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    chunk = out.size
    if size == 1 or chunk == 0:
        transport.copy(out, inp[rank * chunk:(rank + 1) * chunk])
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    segments = split_bounds(0, chunk, segment_count(chunk, segment_elements(segment_bytes, out.itemsize)))
    partials: Any = transport.scratch(2 * chunk, out.dtype) if size > 2 else None  # None: never indexed
    stages = []
    for step in range(size - 1):
        send_chunk, recv_chunk = (rank - step - 1) % size, (rank - step - 2) % size
        if step == 0:
            sending = inp[send_chunk * chunk:(send_chunk + 1) * chunk]
        else:
            sending = partials[(step - 1) % 2 * chunk:((step - 1) % 2 + 1) * chunk]
        last = step == size - 2
        receiving = out if last else partials[step % 2 * chunk:(step % 2 + 1) * chunk]
        own = inp[recv_chunk * chunk:(recv_chunk + 1) * chunk]
        for index, (lo, hi) in enumerate(segments):
            stages.append(Stage(f"ring reduce-scatter step {step} segment {index}",
                                ((sending[lo:hi], right),), ((receiving[lo:hi], left),),
                                (receiving[lo:hi], own[lo:hi], False)))
    # Stage j sends what stage j - len(segments) combined; the partial it lands in was last sent
    # by stage j - len(segments), which is complete before stage j is posted.
    run_stages(transport, stages, op, lag=len(segments), window=PIPELINE_WINDOW)
