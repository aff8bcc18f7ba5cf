"""torch's reduce ops as a plan commlib can run, checked against the tensors' dtype first.

A :class:`Reduction` is commlib's ``ReduceOp`` (``op``), or a numpy bitwise ufunc applied to an
allgather (``bitwise``: commlib has no bitwise reductions), plus an optional factor every
rank's input is multiplied by before a SUM (``premul``: torch's PREMUL_SUM, which FSDP2 asks for
when a gradient divide factor is set). What each dtype allows, as torch's NCCL backend does:

* floats: SUM, AVG, MIN, MAX, PRODUCT, PREMUL_SUM;
* integers: SUM, MIN, MAX, PRODUCT and BAND/BOR/BXOR (AVG would truncate);
* bool: SUM is a logical or (MAX), PRODUCT a logical and (MIN), as NCCL; MIN, MAX and the
  bitwise ops; not AVG. (Summing the bytes would store 2 in a bool.)
* complex (reduced as pairs of reals): SUM, AVG and PREMUL_SUM; MIN, MAX (no order) and PRODUCT
  (not element-wise on the pairs) are refused;
* any other dtype (float8, ...) moves as bytes but cannot be reduced.

Every refusal is an ``InvalidUsageError`` naming the collective, the op, the dtype and the
device, raised before anything is sent.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from commlib import InvalidUsageError, ReduceOp

__all__ = ["RED", "SUM_VALUE", "PLAIN_OPS", "Reduction", "op_value_of", "plan_reduction", "op_name"]

RED = dist.ReduceOp.RedOpType
_TORCH = dist.ReduceOp
# torch op -> commlib op (None for the bitwise ones). ReduceOp.SUM is RedOpType.SUM; torch's stub
# declares the former only.
_COMMLIB = {
    int(_TORCH.SUM.value): ReduceOp.SUM,
    int(_TORCH.AVG.value): ReduceOp.AVG,
    int(_TORCH.MIN.value): ReduceOp.MIN,
    int(_TORCH.MAX.value): ReduceOp.MAX,
    int(_TORCH.PRODUCT.value): ReduceOp.PROD,
}
_BITWISE = {
    int(_TORCH.BAND.value): np.bitwise_and,
    int(_TORCH.BOR.value): np.bitwise_or,
    int(_TORCH.BXOR.value): np.bitwise_xor,
}
SUM_VALUE = int(_TORCH.SUM.value)
_AVG_VALUE = int(_TORCH.AVG.value)
_MIN_VALUE = int(_TORCH.MIN.value)
_MAX_VALUE = int(_TORCH.MAX.value)
_PRODUCT_VALUE = int(_TORCH.PRODUCT.value)
_PREMUL_VALUE = int(_TORCH.PREMUL_SUM.value)
# Indexed by int(RedOpType): a tuple index is cheaper than hashing a pybind enum. The allreduce
# fast path takes only these, on the dtypes of staging.NUMPY_DTYPES (where every op is plain).
PLAIN_OPS = tuple(_COMMLIB.get(value) for value in range(64))

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_INTEGERS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64,
                       torch.uint8, torch.uint16, torch.uint32, torch.uint64})
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})
# bool as its bytes (uint8): these ops give a valid bool (0 or 1) in every byte.
_BOOL_AS = {SUM_VALUE: ReduceOp.MAX, _PRODUCT_VALUE: ReduceOp.MIN,
            _MIN_VALUE: ReduceOp.MIN, _MAX_VALUE: ReduceOp.MAX}


class Reduction(NamedTuple):
    op: Optional[ReduceOp]
    bitwise: Optional[np.ufunc] = None
    premul: Optional[float] = None


def op_value_of(op) -> int:
    """int of a torch ReduceOp / RedOpType (opts.reduceOp is a ReduceOp wrapping a RedOpType)."""
    return int(op.op) if isinstance(op, dist.ReduceOp) else int(op)  # type: ignore[attr-defined]  # bound, not in the stub


def op_name(value: int) -> str:
    try:
        return RED(value).name
    except ValueError:
        return f"op {value}"


def plan_reduction(collective: str, op, tensors) -> Reduction:
    """How to reduce ``tensors`` (torch tensors, one dtype) with torch's ``op`` (a ReduceOp, a
    RedOpType or None for SUM), or ``InvalidUsageError`` naming collective, op, dtype and device."""
    value = SUM_VALUE if op is None else op_value_of(op)
    for tensor in tensors:
        plan = _plan_for(collective, value, op, tensor)
    return plan if tensors else Reduction(_COMMLIB.get(value, ReduceOp.SUM))


def _plan_for(collective: str, value: int, op, tensor: torch.Tensor) -> Reduction:
    dtype = tensor.dtype

    def refuse(reason: str):
        return InvalidUsageError(f"commlib backend: {collective} with {op_name(value)} on a {dtype} tensor on "
                                 f"{tensor.device} is not supported: {reason}")

    if value == _PREMUL_VALUE:
        if dtype not in _FLOATS and dtype not in _COMPLEX:
            raise refuse("PREMUL_SUM scales by a real factor; expected a floating or complex tensor")
        return Reduction(ReduceOp.SUM, premul=_premul_factor(op, refuse))
    if value in _BITWISE:
        if dtype not in _INTEGERS and dtype is not torch.bool:
            raise refuse("bitwise ops need integer or bool tensors")
        if tensor.device.type != "cpu":
            raise refuse("bitwise ops are implemented for cpu tensors only")
        return Reduction(None, _BITWISE[value])
    if value not in _COMMLIB:
        raise refuse("expected SUM, AVG, MIN, MAX, PRODUCT, PREMUL_SUM, or BAND/BOR/BXOR on integers")
    if dtype in _FLOATS:
        return Reduction(_COMMLIB[value])
    if dtype in _INTEGERS:
        if value == _AVG_VALUE:
            raise refuse("the average of integers would truncate; expected a floating tensor, or SUM")
        return Reduction(_COMMLIB[value])
    if dtype is torch.bool:
        if value == _AVG_VALUE:
            raise refuse("bool has no average; expected SUM (or), PRODUCT (and), MIN, MAX or a bitwise op")
        return Reduction(_BOOL_AS[value])
    if dtype in _COMPLEX:
        if value in (_MIN_VALUE, _MAX_VALUE):
            raise refuse("complex numbers have no order; expected SUM, AVG or PREMUL_SUM")
        if value == _PRODUCT_VALUE:
            raise refuse("a complex product is not element-wise on the (real, imaginary) pairs the backend "
                         "reduces; expected SUM, AVG or PREMUL_SUM")
        return Reduction(_COMMLIB[value])
    raise refuse(f"{dtype} tensors move as bytes but have no arithmetic here; expected a float, "
                 f"integer, bool or complex dtype")


def _premul_factor(op, refuse) -> float:
    factor = getattr(op, "factor", None)
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise refuse(f"the PREMUL_SUM factor is a tensor of {factor.numel()} elements; expected one")
        factor = factor.item()
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise refuse(f"PREMUL_SUM needs a numeric factor (dist._make_nccl_premul_sum(f)); got {factor!r}")
    return float(factor)
