"""Inputs derived from the rank, and the results they must give, written out once for every test.

gloo's fixtures are the model: each rank's input is a formula of its rank and the element's
index, so the expected result of a collective has a closed form that any rank (or a test
process with no ranks at all) computes on its own. The values are small integers, exact in every
dtype swept, summed or multiplied over 8 ranks.

* :func:`rank_values` / :func:`closed_form`: for reductions (PROD gets values in {1, 2} so that
  products over 8 ranks stay small).
* :func:`small_values` / :func:`small_values_reduced`: one pattern for every op, for collectives
  that move data as well as reduce it (a broadcast's result is the root's :func:`small_values`).
* :func:`random_bytes`: arbitrary bit patterns (NaN payloads included) rebuilt from a seed, for
  collectives that must deliver bytes unchanged.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Union

import numpy as np

from commlib import ReduceOp

DType = Union[str, np.dtype, type]

try:
    import ml_dtypes

    BFLOAT16: Optional[np.dtype] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bfloat16 is swept where ml_dtypes exists (the test extra installs it)
    BFLOAT16 = None

DTYPE_NAMES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8"]
if BFLOAT16 is not None:
    DTYPE_NAMES.append("bfloat16")


def dtype_of(name: DType) -> np.dtype:
    """``np.dtype(name)``, with ``"bfloat16"`` from ml_dtypes (ImportError where it is missing)."""
    if isinstance(name, str) and name == "bfloat16":
        if BFLOAT16 is None:
            raise ImportError("bfloat16 needs ml_dtypes (pip install ml_dtypes)")
        return BFLOAT16
    return np.dtype(name)


#: Every dtype the collectives accept and the sweeps cover, as ``np.dtype`` objects.
DTYPES: List[np.dtype] = [dtype_of(name) for name in DTYPE_NAMES]
#: Every reduction op; sweeps that cannot check AVG exactly leave it out themselves.
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD]
#: The ops whose result over integers is exact (no division).
EXACT_OPS = [op for op in OPS if op is not ReduceOp.AVG]

_REDUCE: Dict[ReduceOp, Callable[..., np.ndarray]] = {
    ReduceOp.SUM: np.sum, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max, ReduceOp.PROD: np.prod}


def rank_values(rank: int, count: int, op: ReduceOp) -> np.ndarray:
    """Rank ``rank``'s input to a reduction with ``op`` (int64; cast it to the dtype under test)."""
    index = np.arange(count)
    if op is ReduceOp.PROD:
        return (index + rank) % 2 + 1
    return (index + 2 * rank) % 3 + 1


def _reduce(stacked: np.ndarray, op: ReduceOp) -> np.ndarray:
    if op is ReduceOp.AVG:
        return stacked.mean(0)
    return _REDUCE[op](stacked, axis=0)


def closed_form(size: int, count: int, op: ReduceOp, dtype: Optional[DType] = None) -> np.ndarray:
    """The allreduce of :func:`rank_values` over ``size`` ranks.

    Without ``dtype``: float64 (exact: small integers; AVG their mean). With ``dtype``: in that
    dtype, computed over int64 and cast, so that a product that wraps in 8 bits wraps here the
    same way (a cast from float64 would be undefined)."""
    stacked = np.stack([rank_values(rank, count, op) for rank in range(size)]).astype(np.int64)
    result = _reduce(stacked, op)
    if dtype is None:
        return result.astype(np.float64)
    return result.astype(dtype_of(dtype))


def small_values(rank: int, count: int, dtype: DType = np.int64) -> np.ndarray:
    """Rank ``rank``'s input when one pattern serves every op: values 1..3 by rank and index.

    Products over more than 4 ranks overflow 8-bit dtypes (3**5 > 255): sweeps skip those."""
    return ((np.arange(count) + rank) % 3 + 1).astype(dtype_of(dtype))


def small_values_reduced(size: int, count: int, op: ReduceOp, dtype: Optional[DType] = None) -> np.ndarray:
    """The allreduce of :func:`small_values` over ``size`` ranks (float64, or cast to ``dtype``)."""
    stacked = np.stack([small_values(rank, count, np.int64) for rank in range(size)])
    result = _reduce(stacked, op)
    return result.astype(np.float64 if dtype is None else dtype_of(dtype))


def random_bytes(seed: int, count: int, dtype: DType) -> np.ndarray:
    """``count`` elements of ``dtype`` with random bytes (NaN payloads included), from ``seed``."""
    dtype = dtype_of(dtype)
    return np.random.default_rng(seed).integers(0, 256, count * dtype.itemsize, dtype=np.uint8).view(dtype)
