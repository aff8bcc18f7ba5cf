"""The point-to-point engine: one thread, one epoll over a channel's connections, the deadlines.

It runs the matching of :mod:`.p2p_matching` (see there: what goes where, what is held) over the
links of :mod:`.p2p_link`. Every operation ends by its deadline - done, timed out (taking back
what can be), or failed with :class:`commlib.errors.PeerExitedError` as soon as its peer's
connection ends, or ``peers_gone()`` names it (a peer whose process exited while a child it
forked still holds its socket).

The thread starts with the engine, so a peer's departure is seen, and its early messages are
held, before this rank posts anything. Posts run in the caller's thread under the same lock (a
small send is written there at once); completions run after the lock is released, on the
posting thread when a post completes at once, else on the engine's thread.
"""

from __future__ import annotations

import heapq
import os
import select
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from commlib.errors import CommError, GroupAbortedError
from commlib.transports.socket.mesh import connect_mesh, group_id
from commlib.transports.socket.p2p_framing import GOODBYE, P2PCodec
from commlib.transports.socket.p2p_link import Chunk, LinkBroken, P2PLink
from commlib.transports.socket.p2p_matching import (ANY_SOURCE, EAGER_BYTES, MAX_HELD_BYTES, MAX_HELD_MESSAGES,
                                                      Matcher, P2POp)

__all__ = ["P2PEngine", "open_p2p_engine"]

_GONE_CHECK_SECONDS = 0.25  # how often peers_gone() is asked while something waits
_IN, _OUT, _RDHUP = select.EPOLLIN, select.EPOLLOUT, select.EPOLLRDHUP


class P2PEngine(Matcher):
    """The operations of one rank over ``links[peer]`` (None at this rank)."""

    def __init__(self, rank: int, links: Sequence[Optional[P2PLink]], *, name: str,
                 max_held_bytes: int = MAX_HELD_BYTES, max_held_messages: int = MAX_HELD_MESSAGES,
                 peers_gone: Optional[Callable[[], List[int]]] = None):
        super().__init__(links, max_held_bytes, max_held_messages)
        self.rank, self.name = rank, name
        self.peers_gone = peers_gone
        self.lock = threading.Lock()
        self.deadlines: List[Tuple[float, int, P2POp]] = []
        self.closed = False
        self.epoll = select.epoll()
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.epoll.register(self.wake_fd, _IN)
        self.by_fd: Dict[int, P2PLink] = {}
        for link in self.links:
            if link is not None:
                self.by_fd[link.fd] = link
                link.interest = _IN | _RDHUP
                self.epoll.register(link.fd, link.interest)
        self.numbers = 0
        self.next_gone_check = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"commlib-p2p-{name}-r{rank}")
        self.thread.start()

    # -- posting (the caller's thread) -------------------------------------------------------
    def post(self, op: P2POp) -> P2POp:
        with self.lock:
            if self.closed:
                raise GroupAbortedError(f"{op.what}: the group's point-to-point channel is closed")
            self.pending += 1
            op.state = "posting"
            heapq.heappush(self.deadlines, (op.deadline, op.number, op))
            if op.kind == "send":
                self._post_send(op)
            else:
                self._read_arrived(op.peer)
                self._post_recv(op)
            if op.state != "done":
                os.eventfd_write(self.wake_fd, 1)  # a deadline the thread does not know yet
        self._flush()
        return op

    def _read_arrived(self, peer: int) -> None:
        """Read what the peers a receive may match (``peer`` or any) have sent already, before it
        matches: the engine's thread may not have run since it arrived (a loaded machine), and a
        CANCEL there withdraws an announcement held here. A send that gave up (and said so to its
        caller) is then never matched by a receive posted after it, whatever the scheduling."""
        for link in self.links:
            if link is not None and link.ended is None and not link.parked and peer in (ANY_SOURCE, link.peer):
                self._serve(link, _IN)

    # -- frames out --------------------------------------------------------------------------
    def _control(self, link: P2PLink, kind: int, message: int, offset: int = 0) -> None:
        if link.ended is None:
            link.queue(Chunk([memoryview(link.codec.header(kind, message, 0, 0, offset, offset))]))
            self._pump_send(link)

    def _pump_send(self, link: P2PLink) -> None:
        try:
            link.pump_send()
        except LinkBroken:
            self._drain_after_write_failure(link)
        self._update_interest(link)

    def _drain_after_write_failure(self, link: P2PLink) -> None:
        """A write failed: the peer is gone. Read what it sent first (a GOODBYE says how it left)."""
        try:
            link.pump_recv(self)
        except LinkBroken:
            pass
        if link.ended is None:
            link.ended = "reset"
            self.on_end(link, "reset")

    # -- the engine's thread ------------------------------------------------------------------
    def _run(self) -> None:
        while self._step():
            pass

    def _step(self) -> bool:
        """One round: the deadlines, one poll, what it found, the completions. False once closed."""
        with self.lock:
            if self.closed:
                return False
            now = time.monotonic()
            wait = self._expire(now)
            if self.pending and self.peers_gone is not None:
                if now >= self.next_gone_check:
                    self._check_gone()
                    self.next_gone_check = now + _GONE_CHECK_SECONDS
                wait = min(wait, max(self.next_gone_check - now, 0.0))
            if any(link is not None and link.has_pending_tls() for link in self.links):
                wait = 0.0
        self._flush()
        events = self.epoll.poll(wait)
        with self.lock:
            if self._stopping():
                return False
            for fd, mask in events:
                if fd == self.wake_fd:
                    try:
                        os.eventfd_read(self.wake_fd)
                    except BlockingIOError:
                        pass
                    continue
                link = self.by_fd.get(fd)
                if link is not None:
                    self._serve(link, mask)
            for link in self.links:
                if link is not None and link.has_pending_tls():
                    self._serve(link, _IN)
        self._flush()
        return True

    def _stopping(self) -> bool:
        return self.closed  # read afresh after the poll: close() may have run meanwhile

    def _serve(self, link: P2PLink, mask: int) -> None:
        if mask & _OUT:
            try:
                link.pump_send()
            except LinkBroken:
                self._drain_after_write_failure(link)
                return
        if link.parked:
            if mask & (select.EPOLLHUP | select.EPOLLERR):
                self._unregister(link)  # reported whatever the interest: read once unparked
            return
        if link.ended is None:
            try:
                link.pump_recv(self)
            except LinkBroken as broken:
                self._break(link, str(broken))
                return
        self._update_interest(link)

    def _break(self, link: P2PLink, why: str) -> None:
        """The peer sent what no commlib peer sends: every operation with it fails, naming it."""
        link.ended = "broken"
        self._unregister(link)
        self._fail_peer(link, lambda op: CommError(f"{op.what}: {why}; this rank closed the connection"))
        self.held = [held for held in self.held if held.link is not link]
        link.close(None)

    def _check_gone(self) -> None:
        assert self.peers_gone is not None
        for peer in self.peers_gone():
            link = self.links[peer] if 0 <= peer < len(self.links) else None
            if link is not None and link.ended is None:
                link.ended = "board"
                self.on_end(link, "board")

    def _unpark(self, link: P2PLink) -> None:
        try:
            link.unpark(self)
            if not link.parked:
                if link.fd not in self.by_fd and link.ended is None:
                    self.by_fd[link.fd] = link
                    link.interest = 0
                    self.epoll.register(link.fd, 0)
                link.pump_recv(self)
        except LinkBroken as broken:
            self._break(link, str(broken))
            return
        self._update_interest(link)

    def _unpark_all(self) -> None:
        for link in self.links:
            if link is not None and link.parked:
                self._unpark(link)

    def _update_interest(self, link: P2PLink) -> None:
        if link.fd not in self.by_fd:
            return
        if link.ended is not None:
            self._unregister(link)
            return
        interest = (_OUT if link.out else 0) | (0 if link.parked else _IN | _RDHUP)
        if interest != link.interest:
            self.epoll.modify(link.fd, interest)
            link.interest = interest

    def _unregister(self, link: P2PLink) -> None:
        if self.by_fd.pop(link.fd, None) is not None:
            try:
                self.epoll.unregister(link.fd)
            except (OSError, ValueError):
                pass

    # -- deadlines ---------------------------------------------------------------------------
    def _expire(self, now: float) -> float:
        """Fail what is past its deadline; seconds until the next one."""
        heap = self.deadlines
        while heap:
            deadline, _, op = heap[0]
            if op.state == "done":
                heapq.heappop(heap)
                continue
            if deadline > now:
                return min(deadline - now, 3600.0)
            heapq.heappop(heap)
            self.give_up(op)
        return 3600.0

    # -- completion --------------------------------------------------------------------------
    def _flush(self) -> None:
        """Tell the waiters and run callbacks (outside the lock: a callback may post)."""
        with self.lock:
            finished, self.finished = self.finished, []
        for op in finished:
            op.event.set()
            if op.on_done is not None:
                op.on_done(op)

    def wait(self, op: P2POp) -> None:
        """Block until ``op`` ended (its deadline bounds it; the margin covers a stalled thread).

        From the engine's own thread (a work's callback that waits for another operation) the
        wait runs the engine's rounds itself: the thread cannot wait for itself."""
        if threading.current_thread() is self.thread:
            while not op.event.is_set() and self._step():
                pass
            with self.lock:  # closed meanwhile: close() failed it (its waiters hear after the join)
                self._finish(op, GroupAbortedError(f"{op.what}: the group was closed"))
            return
        if not op.event.wait(max(op.deadline - time.monotonic(), 0.0) + 5.0):
            with self.lock:
                self.give_up(op)
            self._flush()
            op.event.wait()

    def next_number(self) -> int:
        with self.lock:
            self.numbers += 1
            return self.numbers

    # -- the end -----------------------------------------------------------------------------
    def close(self, reason: Optional[str] = None) -> None:
        """Fail what is pending (GroupAbortedError, naming ``reason`` when the group was aborted),
        say GOODBYE to every peer, close. Idempotent; from any thread but the engine's."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            ops = (list(self.posted) + list(self.incoming.values()) + list(self.announced.values())
                   + [chunk.owner for link in self.links if link is not None for chunk in link.out
                      if isinstance(chunk.owner, P2POp)])
            why = f"the group was aborted: {reason}" if reason else "the group was closed"
            for op in ops:
                self._finish(op, GroupAbortedError(f"{op.what}: {why}"))
            self.posted, self.incoming, self.announced = [], {}, {}
            os.eventfd_write(self.wake_fd, 1)
        if self.thread is not threading.current_thread():
            self.thread.join()
        self._flush()
        for link in self.links:
            if link is not None and link.ended != "broken":
                link.close(link.codec.header(GOODBYE, 0))
        self.epoll.close()
        os.close(self.wake_fd)


def open_p2p_engine(transport, *, timeout: float, name: str, eager_bytes: int = EAGER_BYTES,
                    max_held_bytes: int = MAX_HELD_BYTES, max_held_messages: int = MAX_HELD_MESSAGES,
                    peers_gone: Optional[Callable[[], List[int]]] = None) -> P2PEngine:
    """Collective over a :class:`commlib.transports.socket.SocketTransport`'s ranks: the engine
    of their point-to-point channel, over a mesh of its own (group ``<transport name>/p2p``,
    built as the transport's is: same rendezvous, secret and options)."""
    mesh_name = f"{transport.name}/p2p"
    mesh = connect_mesh(transport.rendezvous, transport.secret, transport.options, name=mesh_name, timeout=timeout)
    job_id = transport.secret.job_id if transport.secret is not None else bytes(8)
    codec = P2PCodec(job_id, group_id(mesh_name), eager_bytes, transport.options.frame_bytes)
    links = [None if sock is None else P2PLink(sock, peer, mesh.hosts[peer], codec)
             for peer, sock in enumerate(mesh.sockets)]
    return P2PEngine(transport.rank, links, name=name, max_held_bytes=max_held_bytes,
                     max_held_messages=max_held_messages, peers_gone=peers_gone)
