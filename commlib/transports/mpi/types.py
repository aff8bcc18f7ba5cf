"""numpy dtype and ReduceOp -> MPI datatype and MPI op, for the library's own collectives.

MPICH has ``MPIX_C_FLOAT16`` (``MPI.FLOAT16_T``) but no usable bfloat16 reductions, so bfloat16
travels as a 2-byte contiguous type and is combined by a user-defined op written with numpy.
"""

from __future__ import annotations

import functools

import numpy as np
from mpi4py import MPI

from commlib.ops import ReduceOp, ufunc_name

__all__ = ["mpi_datatype", "mpi_op", "MPI_PREDEFINED", "MPI_BUILTIN_OPS"]

# AVG is absent on purpose: the group divides after a SUM.
MPI_BUILTIN_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.PROD: MPI.PROD,
}


MPI_PREDEFINED: dict[np.dtype, MPI.Datatype] = {}


def _needs_user_op(dtype: np.dtype) -> bool:
    return dtype not in MPI_PREDEFINED


@functools.lru_cache(maxsize=None)
def _user_datatype(itemsize: int) -> MPI.Datatype:
    datatype = MPI.BYTE.Create_contiguous(itemsize)
    datatype.Commit()
    return datatype


# Predefined handles only: MPICH refuses built-in ops on derived (even dup'ed) datatypes.
_PREDEFINED = {
    "float16": MPI.FLOAT16_T,
    "float32": MPI.FLOAT,
    "float64": MPI.DOUBLE,
    "int8": MPI.INT8_T,
    "int16": MPI.INT16_T,
    "int32": MPI.INT32_T,
    "int64": MPI.INT64_T,
    "uint8": MPI.UINT8_T,
    "uint16": MPI.UINT16_T,
    "uint32": MPI.UINT32_T,
    "uint64": MPI.UINT64_T,
}


MPI_PREDEFINED.update((np.dtype(name), handle) for name, handle in _PREDEFINED.items())


def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    handle = MPI_PREDEFINED.get(dtype)
    if handle is None:  # bfloat16
        return _user_datatype(dtype.itemsize)
    return handle


@functools.lru_cache(maxsize=None)
def _user_op(dtype_str: str, op: ReduceOp) -> MPI.Op:
    dtype = np.dtype(dtype_str) if not dtype_str.startswith("bfloat16") else _bfloat16()
    combine = getattr(np, ufunc_name(op))

    def apply(inbuf, inoutbuf, datatype):
        src = np.frombuffer(inbuf, dtype=dtype)
        dst = np.frombuffer(inoutbuf, dtype=dtype)
        combine(src, dst, out=dst)

    return MPI.Op.Create(apply, commute=True)


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def mpi_op(dtype: np.dtype, op: ReduceOp) -> MPI.Op:
    if dtype in MPI_PREDEFINED:
        return MPI_BUILTIN_OPS[op]
    return _user_op("bfloat16", op)
