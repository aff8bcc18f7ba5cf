"""The values the benchmark sends: rank-derived inputs whose results have a closed form.

Small integers (1..3, or 1..2 for ``prod``): exact in every dtype the benchmark takes, also
summed or multiplied over a few ranks, so a result is compared with ``==``, never a tolerance.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["rank_input", "reduction", "resolve_dtype", "MPIReduction", "mpi_reduction", "COMBINE"]

COMBINE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def rank_input(rank: int, count: int, dtype, op: str) -> np.ndarray:
    """``count`` elements that depend on ``rank`` and the index (the source of every closed form)."""
    index = np.arange(count, dtype=np.int64)
    values = (index + rank) % 2 + 1 if op == "prod" else (index + rank) % 3 + 1
    return values.astype(dtype)


def reduction(size: int, count: int, dtype, op: str) -> np.ndarray:
    """The reduction with ``op`` of ``rank_input`` over ranks ``0 .. size - 1`` (in int64, then cast)."""
    total = rank_input(0, count, np.int64, op)
    for rank in range(1, size):
        COMBINE[op](total, rank_input(rank, count, np.int64, op), out=total)
    return total.astype(dtype)


def resolve_dtype(name: str) -> np.dtype:
    """A numpy dtype by name; ``bfloat16`` from ``ml_dtypes`` (numpy has none)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class MPIReduction(NamedTuple):
    """The MPI datatype and op the baseline reduces with; ``owned``: created here, to be freed."""

    datatype: Any
    op: Any
    owned: bool

    def free(self) -> None:
        if self.owned:
            self.op.Free()
            self.datatype.Free()


def mpi_reduction(dtype: np.dtype, op: str) -> MPIReduction:
    """The MPI library's datatype and op for ``dtype`` and ``op`` (bfloat16: a numpy user op over
    a contiguous byte type, MPI has no bfloat16). Free it with ``.free()`` before MPI finalizes."""
    from mpi4py import MPI

    datatype = None
    if dtype.name != "bfloat16":
        try:
            datatype = MPI.Datatype.fromcode(dtype.char)
        except (KeyError, ValueError):
            datatype = None
    if datatype is not None:
        return MPIReduction(datatype, {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}[op], False)
    combine = COMBINE[op]

    def apply(inbuf, inoutbuf, _datatype):
        out = np.frombuffer(inoutbuf, dtype=dtype)
        combine(np.frombuffer(inbuf, dtype=dtype), out, out=out)

    return MPIReduction(MPI.BYTE.Create_contiguous(dtype.itemsize).Commit(), MPI.Op.Create(apply, commute=True), True)
