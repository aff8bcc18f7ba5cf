"""The socket transport: the transport contract over TCP, for ranks that have no MPI between them.

``SocketTransport(rendezvous, secret)`` is collective over the rendezvous' ranks: it builds
the mesh (:mod:`.mesh`: one authenticated connection per pair, the listeners closed once it is
up), then moves every ``post`` through one progress engine (:mod:`.progress`) and runs its own
collectives (:mod:`.natives`), so every algorithm of ``commlib/algorithms`` runs over it
unchanged. Messages of a pair match in posting order, checked frame by frame against the
collective's sequence number (the group's ``context.seq``) and the message's number in it
(:mod:`.framing`).

One thread at a time posts and waits (``concurrent_posts`` is False: the hierarchical allreduce
then runs its phases in one thread). ``free_communicator()`` (the group's last step, and the
interpreter's exit for a transport nobody closed) says goodbye to every peer and closes.
"""

from __future__ import annotations

import time
import weakref
from typing import List, Optional, Sequence

import numpy as np

from commlib.rendezvous.interface import Rendezvous
from commlib.rendezvous.secret import JobSecret
from commlib.topology import Topology
from commlib.transports.interface import Pending, Transfer
from commlib.transports.socket.connection import Connection
from commlib.transports.socket.fast_path import make_inline_native
from commlib.transports.socket.framing import FrameCodec
from commlib.transports.socket.mesh import connect_mesh, group_id
from commlib.transports.socket.natives import SocketNativeCollectives
from commlib.transports.socket.options import SocketOptions
from commlib.transports.socket.progress import ProgressEngine

__all__ = ["SocketTransport", "topology_of_hosts"]


def topology_of_hosts(rank: int, hosts: Sequence[str]) -> Topology:
    """The topology of ranks by host name (hosts in order of their lowest rank)."""
    names = list(dict.fromkeys(hosts))
    return Topology(rank, tuple(names), tuple(tuple(r for r, host in enumerate(hosts) if host == name)
                                              for name in names))


class SocketTransport(SocketNativeCollectives):
    xp = np
    concurrent_posts = False
    kind = "socket"

    def __init__(self, rendezvous: Rendezvous, secret: Optional[JobSecret], *,
                 options: Optional[SocketOptions] = None, timeout: float = 300.0, name: str = "world"):
        """Collective over ``rendezvous``: connect to every other rank within ``timeout`` seconds.

        ``secret``: the job's (None: the open key, which authenticates nothing; see
        :mod:`commlib.rendezvous.handshake`). ``name`` must differ between the groups of a job
        (frames carry it): sub-groups made by :meth:`split` get ``name/<n>``.
        """
        super().__init__()
        self.rendezvous = rendezvous
        self.rank, self.size = rendezvous.rank, rendezvous.size
        self.secret = secret
        self.options = options or SocketOptions()
        self.segment_bytes = self.options.segment_bytes
        self.name = name
        self.timeout = timeout
        mesh = connect_mesh(rendezvous, secret, self.options, name=name, timeout=timeout)
        #: Every rank's host name (what errors name and :func:`topology_of_hosts` groups by).
        self.hosts: List[str] = mesh.hosts
        self.topology = topology_of_hosts(self.rank, self.hosts)
        job_id = secret.job_id if secret is not None else bytes(8)
        connections = [None if sock is None else Connection(
            sock, peer, self.hosts[peer], FrameCodec(self.options.frame_checks, job_id, group_id(name),
                                                     self.options.frame_bytes))
            for peer, sock in enumerate(mesh.sockets)]
        self.engine = ProgressEngine(self.rank, connections, self.context)
        self._splits = 0
        # A transport nobody closed says goodbye at exit (or when collected), so its peers can
        # tell "finished and left" from "died" (see connection.Departure).
        self._finalizer = weakref.finalize(self, self.engine.close)

    def __repr__(self) -> str:
        return f"<SocketTransport {self.name!r} rank {self.rank} of {self.size}>"

    def post(self, sends: Sequence[Transfer] = (), recvs: Sequence[Transfer] = ()) -> Pending:
        return self.engine.post(sends, recvs)

    def inline_native(self, collective: str, timeout: float):
        """The small allreduce straight on the sockets (see :mod:`.fast_path`); None for the rest."""
        return make_inline_native(self, collective, timeout)

    def split(self, member: bool, key: int) -> Optional["SocketTransport"]:
        """Collective: the transport of the ranks with ``member`` (ordered by ``key``), over a
        sub-rendezvous and a mesh of its own, within the context's deadline; None elsewhere."""
        self._splits += 1
        assert self.rendezvous is not None  # set in __init__
        sub = self.rendezvous.split(member, key)
        if sub is None:
            return None
        remaining = self.context.deadline - time.monotonic()
        return SocketTransport(sub, self.secret, options=self.options, timeout=max(min(self.timeout, remaining), 0.1),
                               name=f"{self.name}/{self._splits}")

    def free_communicator(self) -> None:
        """Goodbye to every peer, then close the connections. Local; idempotent."""
        self._finalizer()

    def interrupt(self, error: Exception) -> None:
        """From any thread: the collective in progress, and every later one, ends with ``error``
        (see :meth:`.progress.ProgressEngine.interrupt`)."""
        self.engine.interrupt(error)

    @property
    def failed(self) -> Optional[BaseException]:
        """The error that ended the transport (it told its peers), or None."""
        return self.engine.failure
