"""Which GPU a rank uses, and what this process can say about its GPUs before any NCCL call.

``device=None`` means: the rank's index among the ranks on its host, modulo the GPUs that host
shows this process (``CUDA_VISIBLE_DEVICES`` already applied), the convention of torchrun and
Horovod. The arithmetic is a pure function so it is tested without a GPU.

Nothing here imports cupy at module import time: ``import commlib`` must work on a machine
without CuPy or CUDA, and a rank without a GPU must still take part in the preflight exchange
(so every rank can name it in the same error instead of the others hanging).
"""

from __future__ import annotations

import dataclasses
import numbers
import socket
from typing import Dict, List, Optional, Sequence

from commlib.errors import InvalidUsageError

__all__ = ["import_cupy", "local_ranks", "select_device", "LocalGpus", "probe_local_gpus"]


def import_cupy():
    """``cupy``, or ``None`` when it is not installed (an optional extra)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def local_ranks(hosts: Sequence[str]) -> List[int]:
    """For each rank, its index among the ranks that report the same host (in rank order)."""
    seen: Dict[str, int] = {}
    result = []
    for host in hosts:
        index = seen.get(host, 0)
        result.append(index)
        seen[host] = index + 1
    return result


def select_device(local_rank: int, visible: int, explicit=None, *, rank: Optional[int] = None) -> int:
    """The CUDA device ordinal this rank uses; ``InvalidUsageError`` when there is none to use."""
    who = f"rank {rank}" if rank is not None else "this rank"
    if visible <= 0:
        raise InvalidUsageError(f"{who}: a CuPy array on a rank without a GPU (no CUDA device visible)")
    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, numbers.Integral):
            raise InvalidUsageError(f"{who}: device must be an int CUDA ordinal or None, got {explicit!r}")
        if not 0 <= int(explicit) < visible:
            raise InvalidUsageError(
                f"{who}: device={explicit} out of range; this process sees {visible} GPU(s), "
                f"expected 0 <= device < {visible}"
            )
        return int(explicit)
    return local_rank % visible


@dataclasses.dataclass
class LocalGpus:
    """What one rank reports in the preflight exchange (JSON-serialisable fields only)."""

    host: str
    uuids: List[str]          # one per visible device, by ordinal
    nccl_version: int         # 0: NCCL not loadable here
    cupy_version: str         # "" when cupy is absent
    problem: str = ""         # why this rank has no usable GPU ("" when it has one)


def probe_local_gpus(*, want_nccl: bool) -> LocalGpus:
    """Ask CUDA (through cupy) about this process's GPUs; never raises, reports the problem instead."""
    host = socket.gethostname()
    cupy = import_cupy()
    if cupy is None:
        return LocalGpus(host, [], 0, "", "cupy is not installed")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver, no device
        return LocalGpus(host, [], 0, cupy.__version__, f"CUDA unavailable: {exc}")
    uuids = [_device_uuid(cupy, ordinal) for ordinal in range(count)]
    nccl_version = 0
    problem = "" if count else "no CUDA device visible"
    if want_nccl:
        nccl_version, nccl_problem = _nccl_version()
        problem = problem or nccl_problem
    return LocalGpus(host, uuids, nccl_version, cupy.__version__, problem)


def _device_uuid(cupy, ordinal: int) -> str:
    # getDeviceProperties(...)["uuid"] is 16 raw bytes in CuPy builds for CUDA >= 10 (read in
    # cupy_backends/cuda/api/runtime.pyx; unverified on the lent machine). The PCI bus id is
    # the fallback: unique per physical GPU on one host, which is what the duplicate check needs.
    # Cython may turn the char[16] into bytes C-string style, cut at the first zero byte: a
    # shorter value could make two GPUs look alike, so only a full 16 bytes counts as a UUID.
    try:
        raw = cupy.cuda.runtime.getDeviceProperties(ordinal).get("uuid")
        if raw is not None and len(bytes(raw)) == 16:
            return "GPU-" + bytes(raw).hex()
    except Exception:  # noqa: BLE001 - whatever the property read raises, the PCI bus id serves
        pass
    try:
        return "PCI-" + cupy.cuda.runtime.deviceGetPCIBusId(ordinal)
    except Exception:  # noqa: BLE001 - the ordinal is the last resort
        return f"ORDINAL-{ordinal}"


def _nccl_version():
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001 - a missing library or ABI mismatch, reported as the problem
        return 0, (f"cupy.cuda.nccl cannot be imported ({exc}); install nvidia-nccl-cu13 "
                   "or use the host-staged transport")
    if not getattr(nccl, "available", True):
        return 0, "cupy was built without NCCL; use the host-staged transport"
    try:
        return int(nccl.get_version()), ""
    except Exception as exc:  # noqa: BLE001 - libnccl.so.2 not found at first call
        return 0, f"NCCL library not loadable ({exc}); install nvidia-nccl-cu13 or use the host-staged transport"
