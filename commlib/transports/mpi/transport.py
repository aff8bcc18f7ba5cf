"""The MPI transport: point-to-point transfers between ranks of one communicator.

Every transfer moves raw bytes (``MPI.BYTE``), so any dtype numpy knows travels, bfloat16
included; element types matter only to the local reduce. Messages of collective number ``seq``
carry tag ``seq mod 32768``: a rank that skipped or repeated a collective cannot have its
messages matched against the wrong one, and the peers time out instead of computing garbage.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Sequence

import numpy as np
from mpi4py import MPI

from commlib.platform.waiting import wait_all
from commlib.reliability.teardown import release_later
from commlib.transports.interface import Pending, Transfer, Transport
from commlib.transports.mpi.fast_path import make_inline_native, make_inline_pair
from commlib.transports.mpi.natives import TAG_MODULUS, MPINativeCollectives, as_bytes, raise_timeout
from commlib.units import format_bytes

__all__ = ["MPITransport", "as_bytes", "raise_timeout", "run_with_deadline"]


class _MPIPending(Pending):
    __slots__ = ("transport", "requests", "sends", "recvs")

    def __init__(self, transport: "MPITransport", requests, sends, recvs):
        self.transport = transport
        self.requests = requests
        self.sends = sends
        self.recvs = recvs

    def wait(self) -> None:
        transport = self.transport
        if wait_all(self.requests, transport.context.deadline, transport.peer_exited):
            return
        transport.fail_timeout(self.requests, self.sends, self.recvs)


class MPITransport(MPINativeCollectives, Transport):
    xp = np
    local_messages_in_shared_memory = True  # MPICH's shared-memory path between ranks of a host

    def __init__(self, comm: MPI.Comm):
        super().__init__()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.progress_board = None  # set by the group: names laggards in timeout messages

    @property
    def tag(self) -> int:
        return self.context.seq % TAG_MODULUS

    def post(self, sends: Sequence[Transfer] = (), recvs: Sequence[Transfer] = ()) -> Pending:
        comm, tag = self.comm, self.tag
        requests = [comm.Irecv(as_bytes(buf), source=peer, tag=tag) for buf, peer in recvs]
        requests += [comm.Isend(as_bytes(buf), dest=peer, tag=tag) for buf, peer in sends]
        return _MPIPending(self, requests, sends, recvs)

    def inline_native(self, collective: str, timeout: float):
        """See :mod:`.fast_path`."""
        return make_inline_native(self, collective, timeout)

    def inline_pair(self, collective: str, timeout: float):
        """See :func:`.fast_path.make_inline_pair`."""
        return make_inline_pair(self, collective, timeout)

    def wait_transfers(self, requests, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        """Wait for point-to-point ``requests`` (receives first, as ``post`` orders them) as a
        posted exchange would: the context's deadline, then cancel and a named error."""
        _MPIPending(self, requests, sends, recvs).wait()

    # -- communicators --------------------------------------------------------------------------
    def split(self, member: bool, key: int):
        """``MPI_Comm_split`` of this transport's communicator: the new communicator of the ranks
        with ``member`` (ordered by ``key``), None on the others. Collective and blocking (MPI has
        no nonblocking split): it runs on a helper thread, so a peer that never arrives ends in
        ``CommTimeoutError`` at the context's deadline instead of a hang."""
        color = 0 if member else MPI.UNDEFINED
        created = {}

        def split():
            created["comm"] = split_communicator(self.comm, color, key)

        run_with_deadline(split, self, "MPI to create the group (MPI_Comm_split)")
        comm = created["comm"]
        return None if comm == MPI.COMM_NULL else comm

    def free_communicator(self) -> None:
        """Free the communicator (local: ``MPI_Comm_free`` waits for no peer). Idempotent."""
        free_communicator(self.comm)

    def releaser(self):
        """What frees the communicator when its group is collected unclosed (holds no group):
        queued, not run in the collection (:mod:`commlib.reliability.teardown` says why)."""
        return release_later(functools.partial(free_communicator, self.comm))

    def fail_timeout(self, requests, sends, recvs) -> None:
        """Cancel what is still pending (so no late message lands in a user buffer) and raise."""
        n_recv = len(recvs)
        waiting_for = []
        for index, request in enumerate(requests):
            if request.Test():
                continue
            if index < n_recv:
                buf, peer = recvs[index]
                waiting_for.append(f"recv of {format_bytes(buf.nbytes)} from rank {peer}")
                try:
                    request.Cancel()
                    request.Test()
                except MPI.Exception:
                    pass
            else:
                buf, peer = sends[index - n_recv]
                waiting_for.append(f"send of {format_bytes(buf.nbytes)} to rank {peer}")
        raise_timeout(self.rank, self.context, "; ".join(waiting_for) or "completion",
                      self.progress_board)


def free_communicator(comm) -> None:
    """``MPI_Comm_free`` unless freed already or MPI has finalized (local; idempotent)."""
    if comm != MPI.COMM_NULL and not MPI.Is_finalized():
        comm.Free()


def split_communicator(comm, color: int, key: int):
    """``MPI_Comm_split`` (blocking; :meth:`MPITransport.split` runs it with a deadline). A module
    function so that the fault tests can make one rank skip it or hang in it."""
    return comm.Split(color, key)


def run_with_deadline(blocking_call, transport, waiting_for: str) -> None:
    """Run a blocking collective MPI call on a helper thread; raise at the context's deadline.

    A peer that agreed to the call and then never arrived (it died, or hangs) would block the
    call forever; instead the caller gets ``CommTimeoutError`` naming the peers (the group is
    poisoned by it) and the helper thread is left behind in MPI (the job is ending: the error
    aborts it unless caught).
    """
    outcome = {}

    def run():
        try:
            blocking_call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            outcome["error"] = exc

    context = transport.context
    helper = threading.Thread(target=run, name=f"commlib-{context.collective}-{context.seq}", daemon=True)
    helper.start()
    helper.join(max(0.0, context.deadline - time.monotonic()))
    if helper.is_alive():
        raise_timeout(transport.rank, context, waiting_for, transport.progress_board)
    if "error" in outcome:
        raise outcome["error"]
