"""Checks that run in the caller's thread before anything is sent.

Each raises :class:`InvalidUsageError` (or ``TypeError`` for a non-array) with a message that
says which collective, which argument, what was expected and what was given.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import numpy as np

from commlib.errors import InvalidUsageError
from commlib.ops import DTYPE_IS_FLOAT, SUPPORTED_DTYPE_NAMES

__all__ = ["array_kind", "check_buffer", "check_root", "check_timeout", "check_no_overlap", "check_counts",
           "check_peer", "check_tag"]


def array_kind(buf) -> str:
    """``"numpy"`` or ``"cupy"``; anything else is a ``TypeError``."""
    if buf.__class__ is np.ndarray or isinstance(buf, np.ndarray):
        return "numpy"
    module = type(buf).__module__
    if module.startswith("cupy"):
        return "cupy"
    raise TypeError(
        f"expected a numpy.ndarray (or a cupy.ndarray on GPU), got {type(buf).__module__}."
        f"{type(buf).__name__}; convert torch tensors with autograd_bridge"
    )


def check_buffer(buf, collective: str, name: str = "buf", *, writable: bool = True):
    """Return a flat 1-D view of ``buf`` (``buf`` itself if 1-D) after checking it can be used in place."""
    if buf.__class__ is np.ndarray:  # the common case, in a fraction of the general path's time
        flags = buf.flags
        if flags.c_contiguous and (flags.writeable or not writable) and buf.dtype in DTYPE_IS_FLOAT:
            return buf if buf.ndim == 1 else buf.reshape(-1)
    kind = array_kind(buf)
    flags = buf.flags
    if not flags.c_contiguous:
        raise InvalidUsageError(
            f"{collective}: {name} must be C-contiguous (got strides {buf.strides} for shape "
            f"{buf.shape}); pass a contiguous copy (numpy.ascontiguousarray)"
        )
    if writable and kind == "numpy" and not flags.writeable:
        raise InvalidUsageError(f"{collective}: {name} is read-only; expected a writable array")
    if buf.dtype not in DTYPE_IS_FLOAT:
        raise InvalidUsageError(
            f"{collective}: {name} has unsupported dtype {buf.dtype}; expected one of "
            f"{', '.join(SUPPORTED_DTYPE_NAMES)} (bfloat16 through ml_dtypes)"
        )
    return buf.reshape(-1)


def check_same_kind(collective: str, **buffers) -> None:
    arrays = list(buffers.values())
    if all(buf.__class__ is np.ndarray for buf in arrays) and all(buf.dtype == arrays[0].dtype for buf in arrays):
        return  # numpy arrays of one dtype: the common case
    kinds = {name: array_kind(buf) for name, buf in buffers.items()}
    dtypes = {name: buf.dtype for name, buf in buffers.items()}
    if len(set(kinds.values())) > 1:
        raise InvalidUsageError(f"{collective}: buffers live on different devices: {kinds}")
    if "cupy" in kinds.values():
        devices = {name: buf.device.id for name, buf in buffers.items()}
        if len(set(devices.values())) > 1:
            raise InvalidUsageError(f"{collective}: buffers live on different GPUs: {devices}; expected one GPU")
    if len(set(dtypes.values())) > 1:
        shown = ", ".join(f"{name}={dtype}" for name, dtype in dtypes.items())
        raise InvalidUsageError(f"{collective}: buffers must share one dtype, got {shown}")


def check_no_overlap(collective: str, out, inp) -> None:
    """out and inp of allgather/reduce_scatter may not share memory (the result would depend on timing)."""
    if array_kind(out) == "numpy":
        overlap = np.shares_memory(out, inp)
    else:
        out_start, inp_start = out.data.ptr, inp.data.ptr
        overlap = out_start < inp_start + inp.nbytes and inp_start < out_start + out.nbytes
    if overlap and out.size and inp.size:
        raise InvalidUsageError(f"{collective}: out and inp overlap in memory; expected separate buffers")


def check_root(root, size: int, collective: str) -> int:
    if root.__class__ is int and 0 <= root < size:
        return root
    if isinstance(root, bool) or not isinstance(root, numbers.Integral):
        raise InvalidUsageError(f"{collective}: root must be an int rank, got {type(root).__name__}")
    if not 0 <= int(root) < size:
        raise InvalidUsageError(f"{collective}: root {root} out of range; expected 0 <= root < {size}")
    return int(root)


def check_timeout(timeout, what: str) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidUsageError(f"{what}: timeout must be a number of seconds, got {timeout!r}")
    timeout = float(timeout)
    if not (timeout > 0 and math.isfinite(timeout)):
        raise InvalidUsageError(f"{what}: timeout must be a positive finite number of seconds, got {timeout!r}")
    return timeout


def check_counts(counts, size: int, collective: str, name: str, total: int, buffer_name: str) -> tuple:
    """``size`` non-negative element counts that add up to the ``total`` of ``buffer_name``."""
    try:
        values = list(counts)
    except TypeError:
        raise InvalidUsageError(f"{collective}: {name} must be a sequence of {size} ints, got {counts!r}") from None
    if len(values) != size:
        raise InvalidUsageError(f"{collective}: {name} has {len(values)} entries; expected one per rank "
                                f"(world size {size})")
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InvalidUsageError(f"{collective}: {name}[{index}] must be an int, got {value!r}")
        if value < 0:
            raise InvalidUsageError(f"{collective}: {name}[{index}] is {value}; expected a count >= 0")
    checked = tuple(int(value) for value in values)
    if sum(checked) != total:
        raise InvalidUsageError(f"{collective}: {name} add up to {sum(checked)} elements; expected "
                                f"{buffer_name}.size = {total}")
    return checked


def check_peer(peer, size: int, rank: int, what: str, *, any_source: Optional[int] = None) -> int:
    """Another rank of the group (or ``any_source`` where a receive allows it)."""
    if isinstance(peer, bool) or not isinstance(peer, numbers.Integral):
        raise InvalidUsageError(f"{what}: the peer must be an int rank, got {peer!r}")
    peer = int(peer)
    if any_source is not None and peer == any_source:
        return peer
    if not 0 <= peer < size:
        raise InvalidUsageError(f"{what}: rank {peer} out of range; expected 0 <= rank < {size}")
    if peer == rank:
        raise InvalidUsageError(f"{what}: rank {rank} cannot exchange a message with itself; expected "
                                f"another rank of the group")
    return peer


def check_tag(tag, limit: int, what: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, numbers.Integral):
        raise InvalidUsageError(f"{what}: tag must be an int, got {tag!r}")
    if not 0 <= int(tag) < limit:
        raise InvalidUsageError(f"{what}: tag {tag} out of range; expected 0 <= tag < {limit}")
    return int(tag)
