"""torch's reduce ops as commlib's: a commlib ``ReduceOp``, or a numpy bitwise ufunc.

commlib has no bitwise reductions; the backend serves BAND/BOR/BXOR on integer and bool CPU
tensors as an allgather followed by a local reduce with the ufunc.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from commlib import InvalidUsageError, ReduceOp

__all__ = ["RED", "SUM_VALUE", "PLAIN_OPS", "op_value_of", "lookup_op"]

RED = dist.ReduceOp.RedOpType
# torch op -> (commlib op, None) or (None, numpy ufunc for a bitwise allreduce via allgather).
# ReduceOp.SUM is RedOpType.SUM; torch's stub declares the former only.
_TORCH = dist.ReduceOp
_OPS = {
    int(_TORCH.SUM.value): (ReduceOp.SUM, None),
    int(_TORCH.AVG.value): (ReduceOp.AVG, None),
    int(_TORCH.MIN.value): (ReduceOp.MIN, None),
    int(_TORCH.MAX.value): (ReduceOp.MAX, None),
    int(_TORCH.PRODUCT.value): (ReduceOp.PROD, None),
    int(_TORCH.BAND.value): (None, np.bitwise_and),
    int(_TORCH.BOR.value): (None, np.bitwise_or),
    int(_TORCH.BXOR.value): (None, np.bitwise_xor),
}
SUM_VALUE = int(_TORCH.SUM.value)
# Indexed by int(RedOpType): a tuple index is cheaper than hashing a pybind enum.
PLAIN_OPS = tuple(_OPS.get(value, (None, None))[0] for value in range(64))


def op_value_of(op) -> int:
    """int of a torch ReduceOp / RedOpType (opts.reduceOp is a ReduceOp wrapping a RedOpType)."""
    return int(op.op) if isinstance(op, dist.ReduceOp) else int(op)  # type: ignore[attr-defined]  # bound, not in the stub


def lookup_op(value: int, staged):
    """(commlib op, None) or (None, bitwise ufunc) for torch op ``value`` on the ``staged`` tensors."""
    try:
        op, bitwise = _OPS[value]
    except KeyError:
        raise InvalidUsageError(
            f"commlib backend: unsupported reduce op {RED(value).name}; expected SUM, AVG, MIN, MAX, "
            f"PRODUCT, or BAND/BOR/BXOR on integer tensors"
        ) from None
    if bitwise is not None:
        for s in staged:
            if s.cuda_device is not None:
                raise InvalidUsageError(
                    f"commlib backend: {RED(value).name} is implemented for CPU tensors only; got "
                    f"a tensor on {s.tensor.device}"
                )
            if s.tensor.is_floating_point() or s.tensor.is_complex():
                raise InvalidUsageError(
                    f"commlib backend: {RED(value).name} needs integer or bool tensors; got {s.tensor.dtype}"
                )
    return op, bitwise
