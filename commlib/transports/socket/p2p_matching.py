"""Point-to-point matching: which message goes to which receive, and what is held meanwhile.

The terms: a *send* or *receive* is an operation (:class:`P2POp`) posted by a caller with a
peer (a receive may take ``ANY_SOURCE``), a tag and a deadline; a *message* is what a send puts
on its connection (:mod:`.p2p_framing`: EAGER when small, else RTS, then DATA once the receiver
said CTS). Matching follows MPI: an arriving message goes to the earliest posted receive whose
source and tag fit; a posted receive takes the earliest *held* message that fits. Between two
ranks, messages of one tag match receives in posting order (a connection delivers in order, and
both lists are kept in order), so ``ANY_SOURCE`` takes the first fitting message from any peer.

Unexpected messages - arriving before their receive is posted - are *held*, bounded: an EAGER
message's payload (at most ``eager_bytes``) and an RTS's header (the payload stays with its
sender until matched). Past ``max_held_bytes`` of held payload or ``max_held_messages`` held
messages, the connection whose next message does not fit is *parked*: its header is kept, the
rest stays in the kernel, TCP's flow control holds that sender back, and that peer's later
messages wait until receives take held ones (a receive that times out meanwhile says so).

Invariants: no byte lands in a user's buffer after its operation completed (a receive that gave
up has the rest of its message read and dropped; a send that gave up mid-frame finishes that
frame from a copy, then tells the receiver with CANCEL); no buffer is sized by a peer's word
beyond ``eager_bytes``; an operation whose peer's connection ended fails with
:class:`commlib.errors.PeerExitedError` at once.

:class:`Matcher` is the bookkeeping, with no I/O of its own: the engine
(:mod:`.p2p_engine`) moves the bytes, runs the deadlines, and calls it under its lock.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from commlib.errors import CommError, CommTimeoutError, PeerExitedError
from commlib.transports.socket.p2p_framing import CANCEL, CTS, DATA, DECLINE, EAGER, GOODBYE, RTS, P2PFrame
from commlib.transports.socket.p2p_link import PARK, Chunk, LinkBroken, P2PLink, Sink, Stream
from commlib.units import format_bytes

__all__ = ["Matcher", "P2POp", "ANY_SOURCE", "EAGER_BYTES", "MAX_HELD_BYTES", "MAX_HELD_MESSAGES"]

ANY_SOURCE = -1
EAGER_BYTES = 64 << 10
MAX_HELD_BYTES = 64 << 20
MAX_HELD_MESSAGES = 1 << 16
_ENDINGS = {"goodbye": "{who} closed its group",
            "exited": "rank {peer} exited (host {host}: its connection closed)",
            "cut": "rank {peer} exited in the middle of a message (host {host}: its connection closed mid-frame)",
            "reset": "rank {peer} exited (host {host}: its connection was reset)",
            "board": "rank {peer} exited (host {host}: its progress board says so)"}


class P2POp:
    """One send or receive. ``what`` names it in errors ("rank 0: recv #3 of 32 B from rank 1 (tag
    5, group 'world')"); once ``event`` is set, ``error`` says how it ended and ``source`` (a
    receive) who sent."""

    __slots__ = ("kind", "view", "nbytes", "peer", "tag", "timeout", "deadline", "what", "number", "state",
                 "source", "error", "event", "on_done", "link", "message", "received", "stream")

    def __init__(self, kind: str, view: memoryview, peer: int, tag: int, timeout: float, what: str, number: int,
                 on_done: Optional[Callable[["P2POp"], None]] = None):
        self.kind, self.view, self.nbytes = kind, view, len(view)
        self.peer, self.tag = peer, tag
        self.timeout, self.deadline = timeout, time.monotonic() + timeout
        self.what, self.number = what, number
        self.state = "new"
        self.source: Optional[int] = None
        self.error: Optional[BaseException] = None
        self.event = threading.Event()
        self.on_done = on_done
        self.link: Optional[P2PLink] = None
        self.message = 0
        self.received = 0
        self.stream: Optional[Stream] = None


class _Held:
    __slots__ = ("link", "message", "tag", "total", "payload")

    def __init__(self, link: P2PLink, message: int, tag: int, total: int, payload: Optional[bytearray]):
        self.link, self.message, self.tag, self.total, self.payload = link, message, tag, total, payload



class Matcher:
    """The matching state of one rank's channel over ``links[peer]`` (None at this rank)."""

    def __init__(self, links: Sequence[Optional[P2PLink]], max_held_bytes: int, max_held_messages: int):
        self.links = list(links)
        self.max_held_bytes, self.max_held_messages = max_held_bytes, max_held_messages
        self.posted: List[P2POp] = []  # receives not matched yet, in posting order
        self.held: List[_Held] = []  # unexpected messages, in arrival order
        self.held_bytes = 0
        self.incoming: Dict[Tuple[int, int], P2POp] = {}  # (peer, message) -> its matched receive
        self.discarding: Set[Tuple[int, int]] = set()  # messages whose receive gave up mid-way
        self.announced: Dict[Tuple[int, int], P2POp] = {}  # (peer, message) -> its send, until CTS
        self.pending = 0
        self.finished: List[P2POp] = []

    # -- what the engine provides ------------------------------------------------------------
    def _control(self, link: P2PLink, kind: int, message: int, offset: int = 0) -> None:
        """Queue a frame without payload to ``link`` (and write what the socket takes)."""
        raise NotImplementedError

    def _pump_send(self, link: P2PLink) -> None:
        raise NotImplementedError

    def _unpark(self, link: P2PLink) -> None:
        """Offer ``link``'s parked frame again, and read on if it was taken."""
        raise NotImplementedError

    def _unpark_all(self) -> None:
        raise NotImplementedError

    def _unregister(self, link: P2PLink) -> None:
        """Stop watching ``link`` (its stream ended)."""
        raise NotImplementedError

    # -- posting -----------------------------------------------------------------------------
    def _post_send(self, op: P2POp) -> None:
        link = self.links[op.peer]
        assert link is not None
        op.link = link
        if link.ended is not None:
            self._finish(op, self._departed_error(op, link))
            return
        op.message = link.new_message_id()
        codec = link.codec
        if op.nbytes <= codec.eager_bytes:
            header = codec.header(EAGER, op.message, op.tag, op.nbytes, 0, op.nbytes)
            pieces = [memoryview(header)] + ([op.view] if op.nbytes else [])
            link.queue(Chunk(pieces, lambda _link: self._finish(op), op))
        else:
            self.announced[(op.peer, op.message)] = op
            link.queue(Chunk([memoryview(codec.header(RTS, op.message, op.tag, 0, 0, op.nbytes))],
                             lambda _link: self._announced(op), op))
        op.state = "queued"
        self._pump_send(link)

    def _announced(self, op: P2POp) -> None:
        if op.state == "queued":
            op.state = "announced"

    def _post_recv(self, op: P2POp) -> None:
        for index, held in enumerate(self.held):
            if held.tag == op.tag and op.peer in (ANY_SOURCE, held.link.peer):
                del self.held[index]
                self._take_held(op, held)
                return
        if op.peer != ANY_SOURCE:
            link = self.links[op.peer]
            assert link is not None
            if link.ended is not None:
                self._finish(op, self._departed_error(op, link))
                return
        elif all(link is None or link.ended is not None for link in self.links) and len(self.links) > 1:
            self._finish(op, PeerExitedError(f"{op.what} cannot complete: every other rank exited or closed its "
                                             f"group"))
            return
        op.state = "posted"
        self.posted.append(op)
        for link in self.links:  # a parked message may be this receive's
            if link is not None and link.parked and op.peer in (ANY_SOURCE, link.peer):
                self._unpark(link)

    def _take_held(self, op: P2POp, held: _Held) -> None:
        link = held.link
        op.source = link.peer
        if held.payload is not None:
            self.held_bytes -= held.total
            if held.total != op.nbytes:
                self._finish(op, self._size_error(op, link.peer, held.total))
            else:
                op.view[:] = held.payload
                self._finish(op)
            self._unpark_all()
            return
        if held.total != op.nbytes:
            self._finish(op, self._size_error(op, link.peer, held.total))
            self._control(link, DECLINE, held.message)
            return
        if link.ended is not None:
            self._finish(op, self._departed_error(op, link))
            return
        self._match_rendezvous(op, link, held.message)
        self._unpark_all()

    def _match_rendezvous(self, op: P2POp, link: P2PLink, message: int) -> None:
        op.state, op.link, op.message, op.received = "matched", link, message, 0
        self.incoming[(link.peer, message)] = op
        self._control(link, CTS, message)

    def on_frame(self, link: P2PLink, frame: P2PFrame) -> Optional[Sink]:
        kind, key = frame.type, (link.peer, frame.message)
        if kind == EAGER:
            op = self._match(link.peer, frame.tag)
            if op is not None:
                op.source = link.peer
                if frame.total != op.nbytes:
                    self._finish(op, self._size_error(op, link.peer, frame.total))
                    return Sink(None)
                op.state, op.link = "reading", link
                reader: P2POp = op
                return Sink(op.view, lambda _link: self._finish(reader), op)
            if not self._room_for(frame.total):
                return PARK
            payload = bytearray(frame.total)
            self.held_bytes += frame.total
            return Sink(memoryview(payload), lambda _link: self._hold_eager(link, frame, payload))
        if kind == RTS:
            op = self._match(link.peer, frame.tag)
            if op is None:
                if not self._room_for(0):
                    return PARK
                self.held.append(_Held(link, frame.message, frame.tag, frame.total, None))
                return None
            op.source = link.peer
            if frame.total != op.nbytes:
                self._finish(op, self._size_error(op, link.peer, frame.total))
                self._control(link, DECLINE, frame.message)
            else:
                self._match_rendezvous(op, link, frame.message)
            return None
        if kind == DATA:
            op = self.incoming.get(key)
            if op is not None:
                if frame.offset != op.received or frame.total != op.nbytes:
                    raise LinkBroken(f"{link.describe()} sent bytes {frame.offset}.. of a message of "
                                     f"{format_bytes(frame.total)} where byte {op.received} of "
                                     f"{format_bytes(op.nbytes)} was next")
                op.state = "reading"
                end = frame.offset + frame.length
                target: P2POp = op
                return Sink(op.view[frame.offset:end], lambda _link: self._data_in(target, key, end), op)
            if key in self.discarding:
                if frame.offset + frame.length == frame.total:
                    self.discarding.discard(key)
                return Sink(None)
            raise LinkBroken(f"{link.describe()} sent data of message {frame.message}, which no receive here matched")
        if kind in (CTS, DECLINE):
            op = self.announced.pop((link.peer, frame.message), None)
            if op is None:
                return None  # its send gave up meanwhile (and said so with CANCEL)
            if kind == DECLINE:
                self._finish(op)  # the receive failed on the size; the send, as in MPI, is done
            else:
                op.state = "streaming"
                op.stream = Stream(frame.message, op.view, op, lambda _link: self._finish(op))
                link.queue_stream(op.stream)
                self._pump_send(link)
            return None
        if kind == CANCEL:
            self._cancelled(link, frame)
            return None
        if kind == GOODBYE:
            link.goodbye = True
        return None

    def _room_for(self, payload: int) -> bool:
        return len(self.held) < self.max_held_messages and self.held_bytes + payload <= self.max_held_bytes

    def _match(self, peer: int, tag: int) -> Optional[P2POp]:
        for index, op in enumerate(self.posted):
            if op.tag == tag and op.peer in (ANY_SOURCE, peer):
                del self.posted[index]
                return op
        return None

    def _hold_eager(self, link: P2PLink, frame: P2PFrame, payload: bytearray) -> None:
        op = self._match(link.peer, frame.tag)  # posted while the payload was arriving
        held = _Held(link, frame.message, frame.tag, frame.total, payload)
        if op is None:
            self.held.append(held)
        else:
            self._take_held(op, held)

    def _data_in(self, op: P2POp, key: Tuple[int, int], end: int) -> None:
        op.received = end
        if end == op.nbytes:
            self.incoming.pop(key, None)
            self._finish(op)
        else:
            op.state = "matched"

    def _cancelled(self, link: P2PLink, frame: P2PFrame) -> None:
        key = (link.peer, frame.message)
        for index, held in enumerate(self.held):
            if held.link is link and held.message == frame.message:
                del self.held[index]
                self._unpark_all()
                return
        op = self.incoming.pop(key, None)
        if op is not None:
            if op.received == 0 and frame.offset == 0:  # nothing arrived: as if never matched
                op.state, op.source, op.link = "posted", None, None
                self._repost(op)
            else:
                self._finish(op, CommError(
                    f"{op.what}: rank {link.peer} withdrew the message after {format_bytes(frame.offset)} of "
                    f"{format_bytes(op.nbytes)} (its send timed out); {format_bytes(op.received)} arrived here"))
            return
        self.discarding.discard(key)

    def _repost(self, op: P2POp) -> None:
        """Back into the posted list at its place, then offered what is held (the first fit)."""
        position = 0
        while position < len(self.posted) and self.posted[position].number < op.number:
            position += 1
        self.posted.insert(position, op)
        for index, held in enumerate(self.held):
            if held.tag == op.tag and op.peer in (ANY_SOURCE, held.link.peer) and self._first_fit(op, held):
                self.posted.remove(op)
                del self.held[index]
                self._take_held(op, held)
                return

    def _first_fit(self, op: P2POp, held: _Held) -> bool:
        """Whether ``op`` is the earliest posted receive ``held`` fits (non-overtaking)."""
        for other in self.posted:
            if other.tag == held.tag and other.peer in (ANY_SOURCE, held.link.peer):
                return other is op
        return False

    def on_end(self, link: P2PLink, how: str) -> None:
        self._unregister(link)
        self._fail_peer(link, lambda op: self._departed_error(op, link))
        self.held = [held for held in self.held if held.link is not link or held.payload is not None]
        self.discarding = {key for key in self.discarding if key[0] != link.peer}
        if all(other is None or other.ended is not None for other in self.links):
            for op in [op for op in self.posted if op.peer == ANY_SOURCE]:
                self.posted.remove(op)
                self._finish(op, PeerExitedError(f"{op.what} cannot complete: every other rank exited or closed "
                                                 f"its group"))

    def _fail_peer(self, link: P2PLink, error: Callable[[P2POp], BaseException]) -> None:
        peer = link.peer
        for op in [op for op in self.posted if op.peer == peer]:
            self.posted.remove(op)
            self._finish(op, error(op))
        for key in [key for key in self.incoming if key[0] == peer]:
            op = self.incoming.pop(key)
            self._finish(op, error(op))
        for key in [key for key in self.announced if key[0] == peer]:
            op = self.announced.pop(key)
            self._finish(op, error(op))
        for chunk in list(link.out):
            op = chunk.owner
            if isinstance(op, P2POp) and op.state != "done":
                self._finish(op, error(op))
        link.out.clear()

    def _departed_error(self, op: P2POp, link: P2PLink) -> PeerExitedError:
        how = _ENDINGS.get(link.ended or "exited", _ENDINGS["exited"])
        return PeerExitedError(f"{op.what} cannot complete: " + how.format(who=link.describe(), peer=link.peer,
                                                                           host=link.host))

    def _size_error(self, op: P2POp, sender: int, total: int) -> CommError:
        if total > op.nbytes:
            return CommError(f"{op.what}: the message does not fit the receive buffer of {format_bytes(op.nbytes)}: "
                             f"rank {sender} sent {format_bytes(total)} (nothing was written)")
        return CommError(f"{op.what}: rank {sender} sent {format_bytes(total)}; expected {format_bytes(op.nbytes)} "
                         f"(the receive buffer's size; nothing was written)")

    def give_up(self, op: P2POp) -> None:
        """End ``op`` with its timeout, taking back what can be (see the module docstring). Under the lock."""
        if op.state == "done":
            return
        peer = "any rank" if op.peer == ANY_SOURCE else f"rank {op.peer}"
        waited = f"{op.what} timed out after {op.timeout:g} s"
        if op.kind == "recv":
            self._give_up_recv(op, peer, waited)
        else:
            self._give_up_send(op, peer, waited)

    def _give_up_recv(self, op: P2POp, peer: str, waited: str) -> None:
        if op in self.posted:
            self.posted.remove(op)
            self._finish(op, CommTimeoutError(f"{waited} waiting for {peer} to post the matching send"
                                              f"{self._held_note(op)}"))
            return
        link = op.link
        assert link is not None
        arrived = op.received + (link.sink_at if link.sink is not None and link.sink.owner is op else 0)
        if op.message and self.incoming.get((link.peer, op.message)) is op:
            del self.incoming[(link.peer, op.message)]
            self.discarding.add((link.peer, op.message))
        link.discard_rest(op)
        self._finish(op, CommTimeoutError(f"{waited}: rank {link.peer} sent {format_bytes(op.nbytes)}, of which "
                                          f"{format_bytes(arrived)} arrived; the rest is dropped"))

    def _give_up_send(self, op: P2POp, peer: str, waited: str) -> None:
        link = op.link
        assert link is not None
        key = (link.peer, op.message)
        stream = op.stream
        started = link.drop(op)
        self.announced.pop(key, None)
        if op.nbytes <= link.codec.eager_bytes:
            if started is not None:  # the frame must be finished: its rest goes from a copy
                note = (f"; the message could not be taken back, so a receive rank {link.peer} posts later with "
                        f"tag {op.tag} will still get it")
            else:
                note = ""
            self._finish(op, CommTimeoutError(f"{waited} waiting for {peer} to post the matching receive{note}"))
            self._pump_send(link)
            return
        if op.state == "queued" and started is None:  # not even announced
            self._finish(op, CommTimeoutError(f"{waited} waiting for {peer} to post the matching receive"))
            return
        sent = 0
        if stream is not None:
            sent = stream.offset if started is not None else stream.sent
        self._control(link, CANCEL, op.message, sent)
        if sent:
            self._finish(op, CommTimeoutError(f"{waited} with {format_bytes(sent)} of {format_bytes(op.nbytes)} "
                                              f"sent; rank {link.peer}'s receive is told it fails"))
        else:
            self._finish(op, CommTimeoutError(f"{waited} waiting for {peer} to post the matching receive"))

    def _held_note(self, op: P2POp) -> str:
        peers = [link for link in self.links if link is not None and op.peer in (ANY_SOURCE, link.peer)]
        held = [held for held in self.held if held.link in peers]
        notes = []
        if held:
            tags = sorted({entry.tag for entry in held})
            shown = ", ".join(map(str, tags[:8])) + (", ..." if len(tags) > 8 else "")
            source = "those ranks" if len(peers) > 1 else "it"
            notes.append(f"{len(held)} message(s) with other tags ({shown}) from {source} wait here unreceived")
        parked = [link.peer for link in peers if link.parked]
        if parked:
            notes.append(f"later messages of rank(s) {', '.join(map(str, parked))} wait in the kernel: the held "
                         f"messages reached the bound ({len(self.held)} messages, {format_bytes(self.held_bytes)} of "
                         f"{format_bytes(self.max_held_bytes)})")
        return f" ({'; '.join(notes)})" if notes else ""

    def _finish(self, op: P2POp, error: Optional[BaseException] = None) -> None:
        if op.state == "done":
            return
        op.state, op.error = "done", error
        self.pending -= 1
        self.finished.append(op)
