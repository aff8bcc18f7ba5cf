"""``rabenseifner`` reduce: reduce-scatter by recursive halving, then a binomial gather to the root.

Ranks are numbered relative to the root (see :mod:`.binomial`). With ``p = 2^k + rem``, the first
``2 rem`` relative ranks pair up: odd ``2i + 1`` sends its buffer to ``2i``, which combines the
two (its own operand first) and takes part as **virtual rank** ``i``; relative ranks ``>= 2 rem``
are virtual rank ``r - rem``. The root (relative 0) is always virtual rank 0. The buffer is cut
into one **block** per virtual rank.

* Reduce-scatter by recursive halving (:mod:`.halving`): afterwards virtual rank ``v`` holds
  block ``v`` reduced over everyone.
* Gather up the binomial tree of virtual ranks: ``v`` receives the blocks ``[v + m, v + 2m)``
  from ``v + m`` for every ``m`` below its lowest set bit, then sends its blocks ``[v, v +
  lowbit(v))`` to its parent. Invariant: a rank sends only finished blocks, and a parent's
  range is the union of its children's; the root ends with every block.

The root works in its own buffer. Every other rank's buffer is input only: its first exchange
reads the buffer and its results go to a scratch copy-sized work buffer.

Cost (alpha-beta): ``2 log2 p`` steps, ``2 log2 p alpha + 2 n (p-1)/p beta + n (p-1)/p gamma``
(+ one step of ``n`` on folded pairs), against the binomial tree's ``n log2 p`` into the root:
the large-message reduce. Extra memory: ``n`` elements on non-root ranks, ``w + 1`` segments.
"""

from __future__ import annotations

from commlib.algorithms.common.binomial import real_rank, relative_rank
from commlib.algorithms.common.halving import block_span, recursive_halving
from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import Stage, run_stages, scratch_slots
from commlib.ops import ReduceOp

__all__ = ["reduce_rabenseifner"]


def reduce_rabenseifner(transport, buf, root: int, op: ReduceOp, *, segment_bytes: int = 1 << 20) -> None:
    size = transport.size
    if size == 1 or buf.size == 0:
        return
    relative = relative_rank(transport.rank, root, size)
    power = 1 << (size.bit_length() - 1)
    remainder = size - power

    def real_of_virtual(virtual: int) -> int:
        return real_rank(2 * virtual if virtual < remainder else virtual + remainder, root, size)

    segment_elems = segment_elements(segment_bytes, buf.itemsize)
    slots = scratch_slots(transport, min(segment_elems, buf.size), buf.dtype)
    if relative < 2 * remainder and relative % 2 == 1:  # folds into its even neighbour and is done
        _fold_send(transport, buf, real_rank(relative - 1, root, size), segment_elems)
        return
    work = buf if relative == 0 else transport.scratch(buf.size, buf.dtype, slot=1)
    source = buf if relative != 0 else None
    if relative < 2 * remainder:
        _fold_receive(transport, work, source, op, real_rank(relative + 1, root, size), segment_elems, slots)
        source = None
    virtual = relative // 2 if relative < 2 * remainder else relative - remainder
    blocks = split_bounds(0, buf.size, power)
    recursive_halving(transport, work, op, virtual=virtual, power=power, real_rank=real_of_virtual,
                      blocks=blocks, segment_elems=segment_elems, slots=slots, source=source)
    lowest = virtual & -virtual if virtual else power
    mask = 1
    while mask < lowest:  # children's finished blocks, smallest subtree first
        lo, hi = block_span(blocks, virtual + mask, mask)
        transport.step(f"gather from distance {mask}")
        if hi > lo:
            transport.recv(work[lo:hi], real_of_virtual(virtual + mask))
        mask *= 2
    if virtual:
        lo, hi = block_span(blocks, virtual, lowest)
        transport.step(f"gather to distance {lowest}")
        if hi > lo:
            transport.send(work[lo:hi], real_of_virtual(virtual - lowest))


def _segments(count: int, segment_elems: int):
    return split_bounds(0, count, segment_count(count, segment_elems))


def _fold_send(transport, buf, partner: int, segment_elems: int) -> None:
    stages = [Stage(f"fold-in segment {index}", ((buf[lo:hi], partner),), ())
              for index, (lo, hi) in enumerate(_segments(buf.size, segment_elems))]
    run_stages(transport, stages, ReduceOp.SUM, lag=len(stages))


def _fold_receive(transport, work, source, op, partner: int, segment_elems: int, slots) -> None:
    """``work = own (op) partner's``, own first; ``source`` is the own operand when it is not ``work``."""
    stages = []
    for index, (lo, hi) in enumerate(_segments(work.size, segment_elems)):
        if source is None:  # the root: combine into its own buffer
            incoming = slots[index % len(slots)][:hi - lo]
            stages.append(Stage(f"fold-in segment {index}", (), ((incoming, partner),),
                                (work[lo:hi], incoming, False)))
        else:
            stages.append(Stage(f"fold-in segment {index}", (), ((work[lo:hi], partner),),
                                (work[lo:hi], source[lo:hi], True)))
    run_stages(transport, stages, op, lag=len(stages))
