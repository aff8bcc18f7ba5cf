"""The smallest allreduce rounds of the shared-memory transport: through the slots, no messages.

One round (``shm_oneshot``, and the small allreduce's fast path): copy the piece into this rank's
slot (on the signal's own cache line when it fits), signal, wait for every rank's signal of the
same round, then combine all slots in rank order. See :mod:`commlib.transports.shm.transport` for
the counters and their memory ordering.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple

import numpy as np

from commlib.ops import DTYPE_IS_FLOAT, ReduceOp, ufunc_name
from commlib.reliability.progress_board import CODE_BITS, COLLECTIVE_CODES
from commlib.shm.segments import fence, fence_lock
from commlib.transports.shm.layout import (LINE_DATA_BYTES, LOADS_IN_ORDER, ORDERED_COPY_BYTES, SLOT_SIGNAL, TOTAL_MASK,
                                           kind_code)

__all__ = ["build_slot_round", "slot_views"]


def _out_by_keyword(ufunc):
    """``ufunc(a, b, out)`` for the ufuncs that deprecate a positional ``out`` (numpy 2.4:
    ``maximum``, ``minimum``); the others take it positionally, 120 ns faster than by keyword."""
    def combine(a, b, out):
        return ufunc(a, b, out=out)

    return combine


def build_slot_round(self) -> Tuple[Callable[..., bool], Callable[[], None]]:
    """``(slot_round, forget)`` of transport ``self``: one round of ``shm_oneshot``, and what drops
    its views at close.

    ``slot_round(seq, limit, piece, op, total_bytes=None) -> bool``:

    Copy ``piece`` into this rank's slot, signal, wait until every rank signalled the same
    round, then combine all ``P`` slots in rank order into ``piece`` (AVG: and divide).
    ``total_bytes`` is the whole collective's size when ``piece`` is one of its chunks
    (None: the piece is the collective). False, before touching anything, when ``piece``
    or ``op`` is something it does not take (not C-contiguous or read-only, a dtype or op
    it cannot combine, AVG of integers): the caller takes the general path, which explains.

    It is also the small allreduce's fast path, for the executor's inline runner
    (``seq`` > 0: the collective's number, published on the progress board; ``limit`` is
    the runner's, checked by the caller). At 8 bytes the whole call has a budget of about
    a microsecond of Python, and every call, attribute lookup and view built on the way
    costs a tenth of one, so this is one closure over everything it touches, the views of
    the slots for the last kind of piece (shape, dtype, op) in its own variables, switched
    (``prepare``, views kept in ``self.memo``) when the kind changes.
    """
    transport, size = self, self.size
    # The round spins its spin_polls itself (below), then goes straight to the yielding wait.
    peers, own, wait = self.peer_controls, self.own_control, self.waits.wait_yielding
    board = self.progress_board
    progress_slot = board.mine_slot if board is not None and board.mine_slot is not None else [0]
    started = COLLECTIVE_CODES["allreduce"]  # the board's value format: seq << CODE_BITS | code
    fence_acquire, fence_release, loads_in_order = fence_lock.acquire, fence_lock.release, LOADS_IN_ORDER
    signals = (SLOT_SIGNAL, SLOT_SIGNAL + 8)
    spin = range(self.spin_polls)
    # The kind of the last piece and what a round of it needs (see prepare).
    shape = dtype = kind_op = None
    combine: Any = None
    mine: Sequence[np.ndarray] = ()
    first: Sequence[np.ndarray] = ()
    second: Sequence[np.ndarray] = ()
    rest: Sequence[Sequence[np.ndarray]] = ()
    nbytes = kind = whole = 0
    average = store_fence = False

    def prepare(piece, op) -> bool:
        nonlocal shape, dtype, kind_op, combine, mine, first, second, rest, nbytes, kind, whole
        nonlocal average, store_fence
        # Empty: declined (never cached as the last kind, so every empty call comes here). The
        # general path's shm_oneshot does nothing for it, and a rank that ran a round here while
        # its peers did not would wait for them forever.
        if op.__class__ is not ReduceOp or not piece.size:
            return False
        is_float = DTYPE_IS_FLOAT.get(piece.dtype)
        if is_float is None or (op is ReduceOp.AVG and not is_float):
            return False
        if piece.nbytes > self.layout.slot_bytes:
            raise ValueError(f"slot round of {piece.nbytes} bytes: slots hold {self.layout.slot_bytes}")
        key = ("slot_round", piece.shape, piece.dtype, op._value_)  # an Enum member's hash runs Python
        views = self.memo.get(key)
        if views is None:
            if len(self.memo) > 256:
                self.memo.clear()
            views = self.memo[key] = slot_views(self, piece.shape, piece.dtype)
        shape, dtype, kind_op = piece.shape, piece.dtype, op
        mine, first, second, rest = views
        nbytes = transport.inline_nbytes = piece.nbytes  # the context, should it be needed
        kind = kind_code(dtype, op) << 44
        whole = kind | nbytes  # the signature when the round is the whole collective
        combine = getattr(self.xp, ufunc_name(op))
        if op is ReduceOp.MAX or op is ReduceOp.MIN:
            combine = _out_by_keyword(combine)
        average = op is ReduceOp.AVG
        store_fence = nbytes >= ORDERED_COPY_BYTES
        return True

    def slot_round(seq: int, _limit, piece, op, total_bytes=None) -> bool:
        if piece.shape != shape or piece.dtype is not dtype or op is not kind_op:
            if not prepare(piece, op):
                return False
        flags = piece.flags  # as the general path: C-contiguous and writable, or its error
        if not (flags.c_contiguous and flags.writeable):
            return False
        epoch = transport.epoch + 1
        parity = epoch & 1
        mine[parity][...] = piece  # free to write: see "Reuse" in the module docstring
        signal = signals[parity]
        signature = whole if total_bytes is None else kind | total_bytes
        own[signal + 1] = signature
        if store_fence:
            fence_acquire()
            fence_release()
        own[signal] = epoch
        # The bookkeeping after the signal, not before: the peers wait for the signal, not
        # for it (the last rank to arrive makes everyone's time).
        transport.epoch = epoch
        if seq:
            progress_slot[0] = (seq << CODE_BITS) | started  # ProgressBoard.started, inlined
            transport.inline_seq = seq  # the context, should it be needed (see _current_context)
        for peer, control in peers:
            if control[signal] < epoch:
                # Spin here, not in _wait: the rank that waits is the one whose exit is
                # timed, and a call and its return would lie on its path after the peer's
                # signal. Only a wait that outlasts the spin goes on to yield.
                for _ in spin:
                    if control[signal] >= epoch:
                        break
                else:
                    wait(peer, signal, epoch, "arrive")
            if not loads_in_order:  # read the signature after the signal
                fence()
            if control[signal + 1] != signature:
                transport.mismatch(peer, control[signal + 1] & TOTAL_MASK, control[signal + 1] >> 44,
                                    nbytes if total_bytes is None else total_bytes, kind >> 44)
        # ``out`` positional: the keyword costs a ufunc 120 ns more (a tenth of the budget)
        combine(first[parity], second[parity], piece)
        for contribution in rest[parity]:
            combine(piece, contribution, piece)
        if average:
            piece /= size
        return True

    def forget() -> None:  # closing: drop the views of the slots, so the segments can be unmapped
        nonlocal shape, mine, first, second, rest
        shape, mine, first, second, rest = None, (), (), (), ()

    return slot_round, forget


def slot_views(self, shape: tuple, dtype) -> tuple:
    """``(mine, first, second, rest)`` by slot parity: this rank's slot, ranks 0's and 1's, the
    others' (in rank order), as arrays of ``shape`` and ``dtype`` (on the signal's line when
    they fit there: ``LINE_DATA_BYTES``)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes <= LINE_DATA_BYTES:
        offsets = [(SLOT_SIGNAL + 8 * parity + 2) * 8 for parity in (0, 1)]
    else:
        offsets = [offset for offset, _ in self.areas[:2]]
    mine = [self.segment_arrays[self.rank][offset:offset + nbytes].view(dtype).reshape(shape) for offset in offsets]
    everyone = [[self.segment_arrays[peer][offset:offset + nbytes].view(dtype).reshape(shape)
                 for peer in range(self.size)] for offset in offsets]
    first, second = zip(*(pair[:2] for pair in everyone))
    return mine, first, second, [pair[2:] for pair in everyone]
