"""``native``: the transport library's own allreduce (``MPI_Allreduce``, ``ncclAllReduce``).

The baseline every schedule in this package is measured against. The transport implements it,
since only the transport knows its library.
"""

from __future__ import annotations

from ..ops import ReduceOp


def allreduce_native(transport, buf, op: ReduceOp, *, segment_bytes: int = 0) -> None:
    transport.native_allreduce(buf, op)
