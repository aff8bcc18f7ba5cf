"""Point-to-point messages of a group whose ranks have no MPI: the same methods as
:class:`commlib.group.p2p.PointToPoint`, over a socket mesh of their own.

``SocketPointToPoint(transport, timeout=, name=)`` is collective over the socket transport's
ranks: it builds a second mesh beside the transport's (group ``<transport>/p2p``, authenticated
with the job secret like every connection), so no user tag or ``ANY_SOURCE`` receive can meet a
collective's bytes, and a blocked ``recv`` stalls no collective. The semantics are
``PointToPoint``'s: tags ``0 <= tag < tag_limit``, ``ANY_SOURCE``, MPI's order between two ranks
for one tag, ``isend``/``irecv`` returning a :class:`P2PWork`, every operation ending by its
deadline with an error naming this rank, the peer, the tag and the bytes, a receive that gives
up taking nothing more into the caller's buffer, :class:`PeerExitedError` as soon as the peer's
connection ends (a killed peer: milliseconds), size mismatches named with nothing written, and
no error poisoning the group. How messages travel, and how unexpected ones are held (bounded),
is :mod:`commlib.transports.socket.p2p_matching`'s.

Sends complete as MPI's do: a small message (at most ``eager_bytes``) once it is handed to the
kernel, whether or not its receive is posted; a larger one once the receiver took it.
"""

from __future__ import annotations

import weakref
from typing import List, Optional

import numpy as np

from commlib.errors import CommTimeoutError, GroupAbortedError, InvalidUsageError
from commlib.group.p2p import ANY_SOURCE, P2PWork
from commlib.group.validation import array_kind, check_buffer, check_peer, check_tag, check_timeout
from commlib.transports.socket.p2p_engine import open_p2p_engine
from commlib.transports.socket.p2p_matching import EAGER_BYTES, MAX_HELD_BYTES, P2POp
from commlib.transports.socket.progress import byte_view
from commlib.transports.socket.transport import SocketTransport
from commlib.units import format_bytes

__all__ = ["SocketPointToPoint"]

TAG_LIMIT = 1 << 31  # user tags below, the monitored barrier's above: a u32 on the wire


class SocketPointToPoint:
    """The point-to-point channel of one group over sockets (see the module docstring)."""

    def __init__(self, transport: SocketTransport, *, timeout: float, name: str, progress_board=None,
                 eager_bytes: int = EAGER_BYTES, max_held_bytes: int = MAX_HELD_BYTES):
        self.rank, self.size, self.name = transport.rank, transport.size, name
        self.timeout = check_timeout(timeout, "SocketPointToPoint")
        self.tag_limit = TAG_LIMIT
        self.progress_board = progress_board  # the group's: which on-node peers have exited
        self.engine = open_p2p_engine(transport, timeout=self.timeout, name=name, eager_bytes=eager_bytes,
                                      max_held_bytes=max_held_bytes,
                                      peers_gone=progress_board.exited_peers if progress_board is not None else None)
        self._barriers = 0
        weakref.finalize(self, self.engine.close)  # at exit too: the peers hear GOODBYE, not a death

    def __repr__(self) -> str:
        return f"<SocketPointToPoint {self.name!r} rank {self.rank} of {self.size}>"

    # -- blocking ------------------------------------------------------------------------------
    def send(self, buf, dst: int, tag: int = 0, timeout: Optional[float] = None) -> None:
        self._wait_here(self._post("send", buf, dst, tag, timeout))

    def recv(self, buf, src: int, tag: int = 0, timeout: Optional[float] = None) -> int:
        op = self._wait_here(self._post("recv", buf, src, tag, timeout))
        assert op.source is not None
        return op.source

    # -- nonblocking ---------------------------------------------------------------------------
    def isend(self, buf, dst: int, tag: int = 0, timeout: Optional[float] = None) -> P2PWork:
        return self._post("send", buf, dst, tag, timeout, track=True)

    def irecv(self, buf, src: int, tag: int = 0, timeout: Optional[float] = None) -> P2PWork:
        return self._post("recv", buf, src, tag, timeout, track=True)

    # -- the monitored barrier -----------------------------------------------------------------
    def monitored_barrier(self, timeout: Optional[float] = None, wait_all_ranks: bool = False) -> None:
        """As :meth:`commlib.group.p2p.PointToPoint.monitored_barrier`: rank 0 waits up to
        ``timeout`` for every rank, then tells each who did not arrive (the others wait up to
        twice ``timeout`` for that verdict). Raises :class:`CommTimeoutError` naming the missing
        ranks (all with ``wait_all_ranks``, else the lowest)."""
        timeout = self.timeout if timeout is None else check_timeout(timeout, "monitored_barrier")
        self._check_open()
        number = self._barriers = self._barriers + 1
        what = f"rank {self.rank}: monitored_barrier #{number} (group {self.name!r})"
        if self.size == 1:
            return
        tag = self.tag_limit + number % self.tag_limit
        if self.rank != 0:
            token, verdict = np.ones(1, np.uint8), np.zeros(self.size, np.uint8)
            self._internal("send", token, 0, tag, 2 * timeout)
            heard = self._internal("recv", verdict, 0, tag, 2 * timeout)
            self.engine.wait(heard)
            if heard.error is not None:
                if isinstance(heard.error, CommTimeoutError):
                    raise CommTimeoutError(f"{what} timed out after {2 * timeout:g} s waiting for rank 0 to "
                                           f"release it (rank 0 did not arrive, or this rank came too late)")
                raise heard.error
            missing = [peer for peer in range(self.size) if verdict[peer]]
            if missing:
                raise CommTimeoutError(f"{what}: rank(s) {_ranks(missing)} did not arrive within "
                                       f"{timeout:g} s (as rank 0 saw it)")
            return
        tokens = np.zeros(self.size, np.uint8)
        arrivals = [self._internal("recv", tokens[peer:peer + 1], peer, tag, timeout) for peer in range(1, self.size)]
        for op in arrivals:
            self.engine.wait(op)
        late = [op.peer for op in arrivals if op.error is not None]
        verdict = np.zeros(self.size, np.uint8)
        verdict[late if wait_all_ranks else late[:1]] = 1
        for op in arrivals:
            if op.error is None:
                self._internal("send", verdict, op.peer, tag, timeout)  # small: handed to the kernel at once
        if late:
            shown = late if wait_all_ranks else late[:1]
            raise CommTimeoutError(f"{what}: rank(s) {_ranks(shown)} did not arrive within {timeout:g} s"
                                   + ("" if wait_all_ranks or len(late) == 1 else
                                      " (the lowest of the missing; wait_all_ranks=True names all)"))

    # -- internals -----------------------------------------------------------------------------
    def _post(self, kind: str, buf, peer, tag, timeout, track: bool = False):
        what = f"{kind} (group {self.name!r})"
        if array_kind(buf) != "numpy":
            raise InvalidUsageError(f"{what}: rank {self.rank}: point-to-point takes numpy arrays, got a "
                                    f"{type(buf).__module__}.{type(buf).__name__} of {buf.nbytes} bytes for "
                                    f"rank {peer}; copy a GPU array to the host first (nothing was sent)")
        flat = check_buffer(buf, kind, writable=kind == "recv")
        peer = check_peer(peer, self.size, self.rank, what, any_source=ANY_SOURCE if kind == "recv" else None)
        tag = check_tag(tag, self.tag_limit, what)
        timeout = self.timeout if timeout is None else check_timeout(timeout, kind)
        self._check_open()
        number = self.engine.next_number()
        op = P2POp(kind, byte_view(flat, kind == "recv"), peer, tag, timeout, self._describe(kind, number, flat.nbytes,
                                                                                            peer, tag), number)
        if not track:
            return self.engine.post(op)
        work = P2PWork(kind, number, flat.nbytes, flat if kind == "recv" else None)
        work.keepalive = flat  # read or written until the work completes

        def done(finished: P2POp) -> None:
            work.source = finished.source if finished.error is None else None
            work.complete(finished.error)

        op.on_done = done
        self.engine.post(op)
        return work

    def _internal(self, kind: str, buf, peer: int, tag: int, timeout: float) -> P2POp:
        number = self.engine.next_number()
        what = self._describe(kind, number, buf.nbytes, peer, tag)
        return self.engine.post(P2POp(kind, byte_view(buf, kind == "recv"), peer, tag, timeout, what, number))

    def _wait_here(self, op: P2POp) -> P2POp:
        self.engine.wait(op)
        if op.error is not None:
            raise op.error
        return op

    def _describe(self, kind: str, number: int, nbytes: int, peer: int, tag: int) -> str:
        who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
        direction = "to" if kind == "send" else "from"
        return (f"rank {self.rank}: {kind} #{number} of {format_bytes(nbytes)} {direction} {who} (tag {tag}, "
                f"group {self.name!r})")

    def _check_open(self) -> None:
        if self.engine.closed:
            raise GroupAbortedError(f"group {self.name!r}: point-to-point used after the group was closed")

    def close(self) -> None:
        """Fail what is still pending (GroupAbortedError), say goodbye to the peers, close. Local."""
        self.engine.close()


def _ranks(ranks: List[int]) -> str:
    return ", ".join(map(str, ranks))
