"""``recursive_halving`` reduce_scatter: ``log2 p`` exchanges whose size halves each round.

With ``p = 2^k + rem``, the first ``2 rem`` ranks pair up: even ``2i`` sends its whole input to
``2i + 1``, which combines the two and takes part as **virtual rank** ``i`` owning the two
**blocks** ``2i, 2i + 1``; rank ``r >= 2 rem`` is virtual rank ``r - rem`` owning block ``r``.
Virtual ranks own consecutive ranges, so recursive halving (:mod:`.halving`) over them leaves
virtual rank ``v`` with its range reduced over everyone. Finally ``2i + 1`` sends block ``2i``
to ``2i``. ``inp`` is never written: the first exchange reads it and results go to a scratch
work buffer.

Cost (alpha-beta): ``log2 p alpha + n (p-1)/p (beta + gamma)`` for an input of ``n`` elements
when ``p`` is a power of two (latency- and bandwidth-optimal); otherwise two more steps, of
``n`` and ``n/p`` elements, on the folded pairs. Extra memory: ``n`` elements and ``w + 1``
segments.
"""

from __future__ import annotations

from commlib.algorithms.common.halving import recursive_halving
from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import Stage, run_stages, scratch_slots
from commlib.ops import ReduceOp

__all__ = ["reduce_scatter_recursive_halving"]


def reduce_scatter_recursive_halving(transport, out, inp, op: ReduceOp, *,
                                     segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    block = out.size
    if size == 1 or block == 0:
        transport.copy(out, inp[rank * block:(rank + 1) * block])
        return
    power = 1 << (size.bit_length() - 1)
    remainder = size - power
    segment_elems = segment_elements(segment_bytes, out.itemsize)
    segments = split_bounds(0, inp.size, segment_count(inp.size, segment_elems))
    if rank < 2 * remainder and rank % 2 == 0:
        stages = [Stage(f"fold-in segment {index}", ((inp[lo:hi], rank + 1),), ())
                  for index, (lo, hi) in enumerate(segments)]
        run_stages(transport, stages, op, lag=len(stages))
        transport.step("fold-out")
        transport.recv(out, rank + 1)
        return
    work = transport.scratch(inp.size, inp.dtype, slot=1)
    source = inp
    if rank < 2 * remainder:  # work = partner's (op) own, the lower rank's operand first
        stages = [Stage(f"fold-in segment {index}", (), ((work[lo:hi], rank - 1),),
                        (work[lo:hi], inp[lo:hi], False)) for index, (lo, hi) in enumerate(segments)]
        run_stages(transport, stages, op, lag=len(stages))
        source = None
    virtual = rank // 2 if rank < 2 * remainder else rank - remainder

    def first_block(virtual_rank: int) -> int:
        return 2 * virtual_rank if virtual_rank < remainder else virtual_rank + remainder

    def real_rank(virtual_rank: int) -> int:
        return 2 * virtual_rank + 1 if virtual_rank < remainder else virtual_rank + remainder

    blocks = [(first_block(v) * block, first_block(v + 1) * block) for v in range(power)]
    slots = scratch_slots(transport, min(segment_elems, inp.size), inp.dtype)
    recursive_halving(transport, work, op, virtual=virtual, power=power, real_rank=real_rank,
                      blocks=blocks, segment_elems=segment_elems, slots=slots, source=source)
    transport.copy(out, work[rank * block:(rank + 1) * block])
    if rank < 2 * remainder:
        transport.step("fold-out")
        transport.send(work[(rank - 1) * block:rank * block], rank - 1)
