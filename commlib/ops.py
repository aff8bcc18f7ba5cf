"""Reduction operators and the element types the runtime accepts.

The table here is the single source of truth for "which dtype supports which op"; the process
group validates against it before anything is sent, and every transport reduces through
:func:`reduce_into` so all algorithms combine elements the same way.
"""

from __future__ import annotations

import enum

import numpy as np

from commlib.errors import InvalidUsageError

__all__ = ["ReduceOp", "SUPPORTED_DTYPE_NAMES", "DTYPE_IS_FLOAT", "check_op", "is_float_dtype",
           "reduce_into", "reduce_ordered", "ufunc_name"]


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    @classmethod
    def coerce(cls, op) -> "ReduceOp":
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            try:
                return cls[op.upper()]
            except KeyError:
                pass
        raise InvalidUsageError(
            f"unknown reduce op {op!r}: expected one of {', '.join(m.name for m in cls)}"
        )


# AVG is carried out as SUM followed by one division, so the element-wise combine is a SUM.
_UFUNC_NAME = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
    ReduceOp.PROD: "multiply",
}

_FLOAT_NAMES = ("float16", "float32", "float64", "bfloat16")
_INT_NAMES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
SUPPORTED_DTYPE_NAMES = _FLOAT_NAMES + _INT_NAMES


def _supported_dtypes() -> dict:
    """dtype -> is_float. Keyed by dtype objects: ``dtype.name`` costs microseconds a call."""
    table = {np.dtype(name): name in _FLOAT_NAMES for name in SUPPORTED_DTYPE_NAMES if name != "bfloat16"}
    try:  # bfloat16 exists in numpy only through ml_dtypes (an optional extra)
        import ml_dtypes

        table[np.dtype(ml_dtypes.bfloat16)] = True
    except ImportError:
        pass
    return table


DTYPE_IS_FLOAT = _supported_dtypes()


def ufunc_name(op: ReduceOp) -> str:
    return _UFUNC_NAME[op]


def is_float_dtype(dtype) -> bool:
    return DTYPE_IS_FLOAT.get(dtype, False)


def check_op(op: ReduceOp, dtype, collective: str) -> None:
    """AVG of integers would silently truncate, so it is refused rather than guessed."""
    if op is ReduceOp.AVG and not DTYPE_IS_FLOAT[dtype]:
        raise InvalidUsageError(
            f"{collective}: ReduceOp.AVG is undefined for integer dtype {dtype.name} "
            f"(it would truncate); expected a floating dtype, or SUM and divide yourself"
        )


def reduce_into(xp, dst, src, op: ReduceOp) -> None:
    """``dst = dst (op) src`` element-wise, in place, with the array module ``xp``."""
    getattr(xp, _UFUNC_NAME[op])(dst, src, out=dst)


def reduce_ordered(xp, dst, src, op: ReduceOp, src_first: bool) -> None:
    """Like :func:`reduce_into` but with an explicit operand order.

    Floating-point SUM/PROD are commutative in IEEE arithmetic, but algorithms that combine
    partial results pass the lower rank's operand first anyway so every rank evaluates the
    very same expression and ends with the same bits.
    """
    if src_first:
        getattr(xp, _UFUNC_NAME[op])(src, dst, out=dst)
    else:
        getattr(xp, _UFUNC_NAME[op])(dst, src, out=dst)
