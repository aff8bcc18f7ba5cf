"""The cases every algorithm runs over the socket transport: closed forms of the in-process tests
(tests/unit/test_collective_schedules.py, test_schedules.py), fewer dtypes (the transport moves
bytes: the dtypes matter to the reductions, which keep all kinds: half, single, double, bfloat16,
signed and unsigned integers).

``cases(collective, size, rank)`` builds every rank's inputs (so each rank knows the closed form)
and returns ``(label, call(fn, transport), check() -> problem or None)`` for this ``rank``.
"""

from __future__ import annotations

import numpy as np

from commlib import ReduceOp
from tests.support.closed_form import closed_form, dtype_of, rank_values
from tests.unit.test_collective_schedules import alltoall_blocks, alltoallv_counts, mismatch, roots_for, tagged

REDUCING_DTYPES = ["float16", "float32", "float64", "int8", "int64", "uint16", "bfloat16"]
MOVING_DTYPES = ["float32", "int8", "bfloat16"]
OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD]
SEGMENTS = (8, 1 << 20)  # many segments per message, and one


def counts_for(size):
    return sorted({0, 1, max(size - 1, 1), size, 7 * size + 3})


def allreduce_cases(size, rank):
    for dtype_name in REDUCING_DTYPES:
        dtype = dtype_of(dtype_name)
        for op in OPS:
            for count in counts_for(size):
                for segment_bytes in SEGMENTS:
                    buf = rank_values(rank, count, op).astype(dtype)
                    expected = closed_form(size, count, op, dtype)
                    yield (f"{dtype_name} {op.name} n={count} seg={segment_bytes}",
                           lambda fn, t, buf=buf, op=op, s=segment_bytes: fn(t, buf, op, segment_bytes=s),
                           lambda buf=buf, expected=expected: mismatch(buf, expected))
    # Large enough for the native ring (and its segments), in float32 (exact: small integers).
    for count in (70001, (1 << 18) + 5):
        buf = rank_values(rank, count, ReduceOp.SUM).astype(np.float32)
        expected = closed_form(size, count, ReduceOp.SUM, np.float32)
        yield (f"float32 SUM n={count}", lambda fn, t, buf=buf: fn(t, buf, ReduceOp.SUM, segment_bytes=1 << 16),
               lambda buf=buf, expected=expected: mismatch(buf, expected))


def broadcast_cases(size, rank):
    for dtype_name in MOVING_DTYPES:
        dtype = dtype_of(dtype_name)
        for count in counts_for(size) + [300001]:
            for root in roots_for(size):
                for segment_bytes in (SEGMENTS if count < 1000 else (1 << 16,)):  # not 150,000 segments
                    buf = tagged(rank, count, dtype)
                    sent = tagged(root, count, dtype)
                    yield (f"{dtype_name} n={count} root={root} seg={segment_bytes}",
                           lambda fn, t, buf=buf, root=root, s=segment_bytes: fn(t, buf, root, segment_bytes=s),
                           lambda buf=buf, sent=sent: mismatch(buf, sent))


def reduce_cases(size, rank):
    for dtype_name in REDUCING_DTYPES:
        dtype = dtype_of(dtype_name)
        for op in OPS:
            for count in counts_for(size):
                for root in roots_for(size):
                    segment_bytes = SEGMENTS[(count + root) % 2]
                    buf = rank_values(rank, count, op).astype(dtype)
                    before = buf.copy()
                    expected = closed_form(size, count, op, dtype)
                    yield (f"{dtype_name} {op.name} n={count} root={root} seg={segment_bytes}",
                           lambda fn, t, buf=buf, root=root, op=op, s=segment_bytes: fn(t, buf, root, op,
                                                                                        segment_bytes=s),
                           lambda buf=buf, root=root, before=before, expected=expected:
                           mismatch(buf, expected if rank == root else before))


def allgather_cases(size, rank):
    for dtype_name in MOVING_DTYPES:
        dtype = dtype_of(dtype_name)
        for block in (0, 1, 2, 5, 40000):
            inp = tagged(rank, block, dtype)
            before = inp.copy()
            out = np.full(block * size, 99, dtype)
            expected = np.concatenate([tagged(r, block, dtype) for r in range(size)])
            yield (f"{dtype_name} block={block}", lambda fn, t, out=out, inp=inp: fn(t, out, inp, segment_bytes=8),
                   lambda out=out, inp=inp, before=before, expected=expected:
                   mismatch(out, expected) or mismatch(inp, before))


def reduce_scatter_cases(size, rank):
    for dtype_name in REDUCING_DTYPES:
        dtype = dtype_of(dtype_name)
        for op in OPS:
            for block in (0, 1, 3):
                for segment_bytes in SEGMENTS:
                    inp = rank_values(rank, block * size, op).astype(dtype)
                    before = inp.copy()
                    out = np.full(block, 99, dtype)
                    expected = closed_form(size, block * size, op, dtype)[rank * block:(rank + 1) * block]
                    yield (f"{dtype_name} {op.name} block={block} seg={segment_bytes}",
                           lambda fn, t, out=out, inp=inp, op=op, s=segment_bytes: fn(t, out, inp, op,
                                                                                      segment_bytes=s),
                           lambda out=out, inp=inp, before=before, expected=expected:
                           mismatch(out, expected) or mismatch(inp, before))


def alltoall_cases(size, rank):
    for dtype_name in MOVING_DTYPES:
        dtype = dtype_of(dtype_name)
        for block in (0, 1, 3, 5000):
            inp = alltoall_blocks(size, block, dtype)[rank]
            before = inp.copy()
            out = np.full(block * size, 99, dtype)
            expected = np.concatenate([tagged(i, block, dtype, salt=rank) for i in range(size)])
            yield (f"{dtype_name} block={block}", lambda fn, t, out=out, inp=inp: fn(t, out, inp, segment_bytes=8),
                   lambda out=out, inp=inp, before=before, expected=expected:
                   mismatch(out, expected) or mismatch(inp, before))


def alltoallv_cases(size, rank):
    for dtype_name in MOVING_DTYPES:
        dtype = dtype_of(dtype_name)
        for pattern in range(3):
            counts = alltoallv_counts(size, pattern)
            inp = np.concatenate([tagged(rank, counts[rank][j], dtype, salt=j) for j in range(size)]
                                 or [np.empty(0, dtype)])
            out = np.full(sum(counts[i][rank] for i in range(size)), 99, dtype)
            expected = np.concatenate([tagged(i, counts[i][rank], dtype, salt=rank) for i in range(size)])
            yield (f"{dtype_name} pattern={pattern}",
                   lambda fn, t, out=out, inp=inp, counts=counts: fn(
                       t, out, inp, tuple(counts[i][rank] for i in range(size)), tuple(counts[rank]), segment_bytes=8),
                   lambda out=out, expected=expected: mismatch(out, expected))


def gather_cases(size, rank):
    for dtype_name in MOVING_DTYPES:
        dtype = dtype_of(dtype_name)
        for block in (0, 1, 3):
            for root in roots_for(size):
                inp = tagged(rank, block, dtype)
                out = np.full(block * size, 99, dtype) if rank == root else None
                expected = np.concatenate([tagged(r, block, dtype) for r in range(size)])
                yield (f"{dtype_name} block={block} root={root}",
                       lambda fn, t, out=out, inp=inp, root=root: fn(t, out, inp, root, segment_bytes=8),
                       lambda out=out, root=root, expected=expected: mismatch(out, expected) if rank == root else None)


def scatter_cases(size, rank):
    for dtype_name in MOVING_DTYPES:
        dtype = dtype_of(dtype_name)
        for block in (0, 1, 3):
            for root in roots_for(size):
                source = np.concatenate([tagged(r, block, dtype, salt=root) for r in range(size)])
                inp = source.copy() if rank == root else None
                out = np.full(block, 99, dtype)
                yield (f"{dtype_name} block={block} root={root}",
                       lambda fn, t, out=out, inp=inp, root=root: fn(t, out, inp, root, segment_bytes=8),
                       lambda out=out, inp=inp, root=root, source=source, block=block:
                       mismatch(out, source[rank * block:(rank + 1) * block])
                       or (mismatch(inp, source) if rank == root else None))


CASES = {"allreduce": allreduce_cases, "broadcast": broadcast_cases, "reduce": reduce_cases,
         "allgather": allgather_cases, "reduce_scatter": reduce_scatter_cases, "alltoall": alltoall_cases,
         "alltoallv": alltoallv_cases, "gather": gather_cases, "scatter": scatter_cases}


def cases(collective, size, rank):
    return list(CASES[collective](size, rank))
