"""Debug mode: before each collective, every rank shows the others what it is about to do.

The fingerprint is (sequence number, collective, dtype, shape, op, root, algorithm). Ranks first
allgather the *length* of their encoded fingerprint, then the fingerprints padded to the longest,
so fingerprints of different lengths cannot break the exchange itself. Any difference raises
:class:`CollectiveMismatchError` on every rank with the same message, naming the differing fields
and which rank had what; nothing of the collective itself is sent.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from commlib.errors import CollectiveMismatchError

__all__ = ["CallFingerprint", "FingerprintChecker", "describe_mismatch"]

FIELDS = ("seq", "collective", "dtype", "shape", "op", "root", "algorithm")
_SEPARATOR = "\x1f"


class CallFingerprint(NamedTuple):
    """What a call looks like from outside: debug mode compares it across ranks before it runs."""

    dtype: Optional[object]  # None for calls without a buffer (barrier)
    shape: Tuple[Any, ...]  # the buffer's shape; ("v",) for alltoallv, whose sizes differ per rank
    op: str  # the ReduceOp's name, "" for collectives that do not reduce
    root: int  # -1 for collectives without a root
    algorithm: str


def encode(values) -> bytes:
    return _SEPARATOR.join(str(v) for v in values).encode()


def decode(raw: bytes):
    return raw.decode(errors="replace").split(_SEPARATOR)


def describe_mismatch(per_rank, collective: str, seq: int, hosts=None) -> str:
    """per_rank: list of field-value lists, one per rank; hosts: each rank's host name, given
    when the group spans hosts."""
    differences = []
    for index, field in enumerate(FIELDS):
        values = [fields[index] if index < len(fields) else "?" for fields in per_rank]
        if len(set(values)) > 1:
            groups: Dict[object, List[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(value, []).append(rank)
            shown = " vs ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {v}"
                                for v, r in groups.items())
            differences.append(f"{field} differs ({shown})")
    where = (lambda rank: f" on host {hosts[rank]}") if hosts else (lambda rank: "")
    summary = " | ".join(
        f"rank {rank}{where(rank)} {fields[1]} {fields[2]}{fields[3]}" for rank, fields in enumerate(per_rank)
        if len(fields) >= 4
    )
    return (f"collective mismatch at {collective} #{seq}: " + "; ".join(differences)
            + f". Calls: {summary}")


class FingerprintChecker:
    def __init__(self, group):
        self.group = group

    def check(self, collective: str, seq: int, algorithm: str, fingerprint: CallFingerprint) -> None:
        dtype_text = "-" if fingerprint.dtype is None else str(fingerprint.dtype)
        mine = encode((seq, collective, dtype_text, tuple(fingerprint.shape), fingerprint.op or "-",
                       fingerprint.root, algorithm))
        transport, size = self.group.transport, self.group.size
        if size == 1:
            return
        lengths = np.empty(size, np.int64)
        transport.native_allgather(lengths, np.array([len(mine)], np.int64))
        width = int(lengths.max())
        padded = np.zeros(width, np.uint8)
        padded[:len(mine)] = np.frombuffer(mine, np.uint8)
        gathered = np.empty(width * size, np.uint8)
        transport.native_allgather(gathered, padded)
        per_rank = [decode(gathered[r * width:r * width + int(lengths[r])].tobytes()) for r in range(size)]
        if any(fields != per_rank[0] for fields in per_rank):
            topology = self.group.topology
            hosts = [topology.host_name_of(r) for r in range(size)] if topology.spans_hosts else None
            raise CollectiveMismatchError(describe_mismatch(per_rank, collective, seq, hosts))
