"""``native``: the transport library's own collectives (``MPI_Allreduce``, ``ncclAllGather``, ...).

The baseline every schedule in this package is measured against. The transport implements them,
since only the transport knows its library; where a library has no such collective (NCCL has no
gather, scatter or alltoall) the transport's default posts every transfer of the collective at
once (see :class:`commlib.transports.interface.Transport`). On one rank they are local copies, so the
libraries are never asked for a collective of one.
"""

from __future__ import annotations

from commlib.ops import ReduceOp


def allreduce_native(transport, buf, op: ReduceOp, *, segment_bytes: int = 0) -> None:
    transport.native_allreduce(buf, op)


def broadcast_native(transport, buf, root: int, *, segment_bytes: int = 0) -> None:
    if transport.size > 1:
        transport.native_broadcast(buf, root)


def reduce_native(transport, buf, root: int, op: ReduceOp, *, segment_bytes: int = 0) -> None:
    if transport.size > 1:
        transport.native_reduce(buf, root, op)


def allgather_native(transport, out, inp, *, segment_bytes: int = 0) -> None:
    if transport.size > 1:
        transport.native_allgather(out, inp)
    else:
        transport.copy(out, inp)


def reduce_scatter_native(transport, out, inp, op: ReduceOp, *, segment_bytes: int = 0) -> None:
    if transport.size > 1:
        transport.native_reduce_scatter(out, inp, op)
    else:
        transport.copy(out, inp)


def alltoall_native(transport, out, inp, *, segment_bytes: int = 0) -> None:
    if transport.size > 1:
        transport.native_alltoall(out, inp)
    else:
        transport.copy(out, inp)


def alltoallv_native(transport, out, inp, out_counts, in_counts, *, segment_bytes: int = 0) -> None:
    if transport.size > 1:
        transport.native_alltoallv(out, inp, out_counts, in_counts)
    else:
        transport.copy(out, inp)


def gather_native(transport, out, inp, root: int, *, segment_bytes: int = 0) -> None:
    if transport.size > 1:
        transport.native_gather(out, inp, root)
    else:
        transport.copy(out, inp)


def scatter_native(transport, out, inp, root: int, *, segment_bytes: int = 0) -> None:
    if transport.size > 1:
        transport.native_scatter(out, inp, root)
    else:
        transport.copy(out, inp)


def barrier_native(transport, *, segment_bytes: int = 0) -> None:
    if transport.size > 1:
        transport.native_barrier()
