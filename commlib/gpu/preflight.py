"""Preflight: before NCCL is initialised, every rank learns every other rank's GPU.

NCCL, given two ranks on one GPU, fails with "Duplicate GPU detected" on some ranks and hangs on
others; given two NCCL versions, it may hang or corrupt. So each rank first allgathers a small
record (host, GPU UUIDs, NCCL version, chosen device) over MPI, and every rank runs the same
pure decision function on the same records: either all ranks continue, or all raise the same
:class:`GpuSetupError` naming the ranks at fault. Nobody waits for a peer that already gave up.

The exchange is one ``MPI_Iallgather`` of fixed-size JSON buffers, waited with the group's
deadline: a rank that never makes its first GPU call becomes a ``CommTimeoutError``, not a hang.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from commlib.errors import CommTimeoutError, InvalidUsageError
from commlib.gpu.device import LocalGpus, local_ranks, select_device

__all__ = ["GpuSetupError", "RankRecord", "exchange_records", "decide", "format_nccl_version",
           "RECORD_BYTES"]

RECORD_BYTES = 8192
TRANSPORTS = ("nccl", "host_staged")


class GpuSetupError(InvalidUsageError):
    """The ranks' GPUs cannot form the requested communicator; raised identically on every rank."""


@dataclasses.dataclass
class RankRecord:
    rank: int
    transport: str
    explicit_device: Optional[int]
    gpus: LocalGpus

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, text: bytes) -> "RankRecord":
        data = json.loads(text.decode())
        data["gpus"] = LocalGpus(**data["gpus"])
        return cls(**data)


def _encode(record: RankRecord) -> np.ndarray:
    payload = record.to_json()
    if len(payload) > RECORD_BYTES:  # absurdly many GPUs or a huge problem text: keep it valid
        record = dataclasses.replace(record, gpus=dataclasses.replace(
            record.gpus, uuids=record.gpus.uuids[:64], problem=record.gpus.problem[:500]))
        payload = record.to_json()
    buf = np.zeros(RECORD_BYTES, dtype=np.uint8)
    buf[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    return buf


def _decode(buf: np.ndarray) -> RankRecord:
    raw = buf.tobytes().rstrip(b"\0")
    return RankRecord.from_json(raw)


def exchange_records(comm, record: RankRecord, timeout: float) -> List[RankRecord]:
    """Allgather ``record`` over the MPI communicator ``comm``; records come back in rank order."""
    from commlib.platform.waiting import wait_all

    send = _encode(record)
    recv = np.empty(RECORD_BYTES * comm.Get_size(), dtype=np.uint8)
    request = comm.Iallgather(send, recv)
    if not wait_all([request], time.monotonic() + timeout):
        raise CommTimeoutError(
            f"rank {comm.Get_rank()}: GPU preflight timed out after {timeout:g} s waiting for the "
            f"other rank(s) to make their first GPU collective"
        )
    return [_decode(recv[i * RECORD_BYTES:(i + 1) * RECORD_BYTES]) for i in range(comm.Get_size())]


def format_nccl_version(code: int) -> str:
    if code <= 0:
        return "none"
    if code >= 20900:  # NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def decide(records: Sequence[RankRecord]) -> List[int]:
    """The device of every rank, or ``GpuSetupError`` naming the ranks at fault. Pure."""
    records = sorted(records, key=lambda r: r.rank)
    transports = {r.transport for r in records}
    if len(transports) > 1:
        by_kind: Dict[str, List[int]] = {}
        for r in records:
            by_kind.setdefault(r.transport, []).append(r.rank)
        shown = "; ".join(f"{kind} on {_ranks_text(ranks)}" for kind, ranks in sorted(by_kind.items()))
        raise GpuSetupError(f"GPU preflight: ranks disagree on the GPU transport: {shown}")
    transport = transports.pop()
    if transport not in TRANSPORTS:
        raise GpuSetupError(f"GPU preflight: unknown GPU transport {transport!r}; expected one of {TRANSPORTS}")

    without_gpu = [r for r in records if r.gpus.problem]
    if without_gpu:
        shown = "; ".join(f"rank {r.rank} on {r.gpus.host}: {r.gpus.problem}" for r in without_gpu)
        if all(not r.gpus.uuids for r in without_gpu):
            raise GpuSetupError(f"GPU preflight: a CuPy array on a rank without a usable GPU ({shown})")
        raise GpuSetupError(f"GPU preflight: the {transport} GPU transport cannot run on every rank ({shown})")

    locals_ = local_ranks([r.gpus.host for r in records])
    devices, bad = [], []
    for record, local in zip(records, locals_):
        try:
            devices.append(select_device(local, len(record.gpus.uuids), record.explicit_device,
                                         rank=record.rank))
        except InvalidUsageError as exc:
            bad.append(str(exc))
    if bad:
        raise GpuSetupError("GPU preflight: " + "; ".join(bad))

    if transport == "nccl":
        _check_one_rank_per_gpu(records, devices)
        _check_same_nccl(records)
    return devices


def _gpu_key(record: RankRecord, device: int):
    uuid = record.gpus.uuids[device]
    # A real UUID is unique across hosts; a PCI bus id fallback only within one host.
    return uuid if uuid.startswith("GPU-") else (record.gpus.host, uuid)


def _check_one_rank_per_gpu(records: Sequence[RankRecord], devices: Sequence[int]) -> None:
    users: Dict[object, List[int]] = {}
    for record, device in zip(records, devices):
        users.setdefault(_gpu_key(record, device), []).append(record.rank)
    shared = [ranks for ranks in users.values() if len(ranks) > 1]
    if not shared:
        return
    parts = []
    for ranks in shared:
        first = records[ranks[0]]
        device = devices[ranks[0]]
        parts.append(f"{_ranks_text(ranks)} on host {first.gpus.host} would all use GPU {device} "
                     f"({first.gpus.uuids[device]})")
    raise GpuSetupError(
        "GPU preflight: NCCL allows one rank per GPU (it would fail with 'Duplicate GPU detected' "
        "or hang), but " + "; ".join(parts) + ". Run at most one rank per GPU, pass device=, or "
        "use the host-staged transport (COMMLIB_GPU_TRANSPORT=host_staged) to share a GPU"
    )


def _check_same_nccl(records: Sequence[RankRecord]) -> None:
    by_version: Dict[int, List[int]] = {}
    for record in records:
        by_version.setdefault(record.gpus.nccl_version, []).append(record.rank)
    if len(by_version) > 1:
        shown = "; ".join(f"NCCL {format_nccl_version(v)} on {_ranks_text(ranks)}"
                          for v, ranks in sorted(by_version.items(), reverse=True))
        raise GpuSetupError(f"GPU preflight: NCCL versions differ across ranks ({shown}); "
                            f"install the same nvidia-nccl package on every node")
