"""Folding a non-power-of-two world onto a power of two (recursive doubling, rabenseifner).

With ``p = 2^k + rem`` ranks, the first ``2 rem`` ranks pair up before the main phase: each
even rank ``2i`` sends its whole buffer to ``2i + 1``, which combines the two (the lower rank's
operand first, so the bytes do not depend on who computed them) and takes part as **virtual
rank** ``i``; the even rank sits out. Ranks ``>= 2 rem`` are virtual rank ``r - rem``. After the
main phase among ``2^k`` virtual ranks, each odd rank sends the result back to its even partner.
Cost: two extra steps of ``n`` elements on the folded pairs, none elsewhere.
"""

from __future__ import annotations

from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import PIPELINE_WINDOW, Stage, run_stages, scratch_slots
from commlib.ops import ReduceOp

__all__ = ["Fold", "fold_in", "fold_out"]


class Fold:
    """The virtual-rank map of one world size."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank
        self.power = 1 << (size.bit_length() - 1)
        self.remainder = size - self.power
        if rank < 2 * self.remainder:
            self.virtual_rank = -1 if rank % 2 == 0 else rank // 2
        else:
            self.virtual_rank = rank - self.remainder

    def real_rank(self, virtual_rank: int) -> int:
        if virtual_rank < self.remainder:
            return 2 * virtual_rank + 1
        return virtual_rank + self.remainder


def fold_in(transport, fold: Fold, buf, op: ReduceOp, segment_bytes: int) -> None:
    """Even ranks of the first ``2 rem`` send their buffer to the odd neighbour, which reduces it."""
    rank = fold.rank
    if rank >= 2 * fold.remainder:
        return
    segment_elems = segment_elements(segment_bytes, buf.itemsize)
    segments = split_bounds(0, buf.size, segment_count(buf.size, segment_elems))
    stages = []
    if rank % 2 == 0:
        for index, (lo, hi) in enumerate(segments):
            stages.append(Stage(f"fold-in segment {index}", ((buf[lo:hi], rank + 1),), ()))
    else:
        slots = scratch_slots(transport, segments[0][1] - segments[0][0], buf.dtype)
        for index, (lo, hi) in enumerate(segments):
            incoming = slots[index % len(slots)][:hi - lo]
            stages.append(Stage(f"fold-in segment {index}", (), ((incoming, rank - 1),),
                                (buf[lo:hi], incoming, True)))
    run_stages(transport, stages, op, lag=len(stages), window=PIPELINE_WINDOW)


def fold_out(transport, fold: Fold, buf) -> None:
    """Odd ranks of the first ``2 rem`` hand the result back to their even neighbour."""
    rank = fold.rank
    if rank >= 2 * fold.remainder:
        return
    transport.step("fold-out")
    if rank % 2 == 1:
        transport.send(buf, rank - 1)
    else:
        transport.recv(buf, rank + 1)
