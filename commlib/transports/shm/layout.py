"""The layout of a rank's shared-memory segment: its control words, its areas, and the words
that name what a rank contributes to a round (compared across ranks before anything is read).

See :mod:`commlib.transports.shm.transport` for what the counters mean and the memory-ordering
rules; this module holds only the numbers every part of the transport (and the ``shm_*``
schedules) must agree on.
"""

from __future__ import annotations

import platform
from typing import NamedTuple

from commlib.ops import DTYPE_IS_FLOAT, ReduceOp
from commlib.shm.segments import PAGE_BYTES

__all__ = ["SegmentLayout", "kind_code", "move_kind_code", "describe_kind", "ARRIVE", "PROGRESS", "ADDRESS",
           "OUTPUT", "DONE", "SLOT_SIGNAL", "LINE_DATA_BYTES", "PROGRESS_BITS", "CONTROL_BYTES", "LOADS_IN_ORDER",
           "ORDERED_COPY_BYTES", "ROUND_WORDS", "TOTAL_MASK"]

# Control words (int64 indices into a segment's control page); one 64-byte line each.
ARRIVE = 0          # epoch; descriptor at ARRIVE + 2 + 4 * (epoch & 1), see arrive()
PROGRESS = 16       # (epoch << PROGRESS_BITS) | chunks of this rank's slice reduced so far
ADDRESS = 10        # + epoch parity: the virtual address of this rank's buffer (cross-memory rounds)
OUTPUT = 12         # + epoch parity: where this rank's output is in its segment (0: not there)
DONE = 24           # epoch whose reads of peers' buffers in place this rank has finished (depart)
SLOT_SIGNAL = 32    # per slot parity p, a line each: [SLOT_SIGNAL + 8p] epoch, [+ 1] signature, [+ 2 ..] data
# A round of at most this many bytes carries its data on its signal's cache line (after the epoch
# and the signature), not in the slot: the peer that sees the signal has the data in the same
# line, one cache miss fewer (NCCL's LL protocol does the same with flags beside the data).
LINE_DATA_BYTES = 48
PROGRESS_BITS = 24
CONTROL_BYTES = PAGE_BYTES

# x86 (Intel and AMD) never reorders a load with an older load, so a reader that saw a counter
# reads the data stored before it without a fence; other architectures need the reader's fence.
LOADS_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
# A copy of fewer bytes is plain (vector) stores, which x86 makes visible in program order, so the
# counter written after it needs no fence: glibc's memcpy (numpy's copies) switches to fast-string
# stores from 2 KiB (its smallest `rep movsb` threshold) and to non-temporal ones far above.
# Elsewhere every copy is followed by a fence. (Measured: the fence is 0.1 us of an 8-byte round.)
ORDERED_COPY_BYTES = 2048 if LOADS_IN_ORDER else 0

# A round of an epoch raises ARRIVE (shm_twoshot, shm_direct) or its slot's signal (shm_oneshot),
# never both: a peer waited for on one that raised the other for the same epoch diverged.
ROUND_WORDS = frozenset((ARRIVE, SLOT_SIGNAL, SLOT_SIGNAL + 8))
TOTAL_MASK = (1 << 44) - 1  # a slot signature: kind_code << 44 | the collective's total bytes
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPE_IS_FLOAT, start=1)}
_OP_CODES = {op: code for code, op in enumerate(ReduceOp, start=1)}


def kind_code(dtype, op: ReduceOp) -> int:
    """One word naming a contribution's dtype and op, compared across ranks at arrival."""
    return (_DTYPE_CODES[dtype] << 8) | _OP_CODES[op]


# The data-movement collectives (shm_direct) compare which collective, not a dtype and op: they
# move bytes. Above every kind_code (dtype codes < 256).
_MOVE_KINDS = ("broadcast", "allgather", "gather", "scatter", "alltoall")
_MOVE_KIND_BASE = 1 << 16


def move_kind_code(collective: str) -> int:
    """The kind word of a data-movement collective, compared across ranks at arrival."""
    return _MOVE_KIND_BASE + _MOVE_KINDS.index(collective)


def describe_kind(code: int) -> str:
    if code >= _MOVE_KIND_BASE:
        index = code - _MOVE_KIND_BASE
        return f"{_MOVE_KINDS[index] if index < len(_MOVE_KINDS) else '?'} bytes"
    dtypes = {value: key for key, value in _DTYPE_CODES.items()}
    ops = {value: key for key, value in _OP_CODES.items()}
    dtype, op = dtypes.get(code >> 8), ops.get(code & 0xFF)
    return f"{dtype if dtype is not None else '?'} {op.name if op is not None else '?'}"


class SegmentLayout(NamedTuple):
    """Byte offsets in every rank's segment (page-aligned)."""

    slot_bytes: int      # each of the two small-message slots
    staging_bytes: int   # each of the two staging halves
    heap_bytes: int

    @property
    def slots_start(self) -> int:
        return CONTROL_BYTES

    @property
    def staging_start(self) -> int:
        return CONTROL_BYTES + 2 * self.slot_bytes

    @property
    def heap_start(self) -> int:
        return self.staging_start + 2 * self.staging_bytes

    @property
    def total_bytes(self) -> int:
        return self.heap_start + self.heap_bytes

    @classmethod
    def create(cls, slot_bytes: int, staging_bytes: int, heap_bytes: int) -> "SegmentLayout":
        def pages(nbytes):
            return max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)
        return cls(pages(slot_bytes), pages(staging_bytes), -(-heap_bytes // PAGE_BYTES) * PAGE_BYTES)
