"""One authenticated connection to one peer: its send and receive queues and their state machines.

Sends go out in posting order, each message as frames (:mod:`.framing`): header and payload in
one ``sendmsg`` straight from the user's buffer. Receives are matched in posting order too. A
frame's header is read into the connection's own 56 bytes and checked against the receive at
the head of the queue; only then is its payload read, with ``recv_into`` straight into the
user's buffer (zero-copy). A small receive (at most :data:`PREFETCH_BYTES`) reads header and
payload in one call into a bounce buffer and copies the payload: one system call instead of two.

A data frame that arrives before its receive is posted (the peer is ahead) is *parked*: its
header is read, its payload left in the kernel (TCP's flow control holds the peer back), so an
unexpected message costs 56 bytes here, never a buffer of its size. Control frames (GOODBYE,
ABORT) are read whenever they come.

When the peer's side closes, what it sent before is drained into a *tail* (bounded by the
kernel's receive buffer: nothing arrives after the close) and scanned to tell how it left: a
GOODBYE (it closed its group), an ABORT (it gave up on the group and says why), a close in the
middle of a frame, a reset, or a plain close at a frame boundary. The tail still serves later
receives, so a peer that finished its part and exited leaves nothing unread.
"""

from __future__ import annotations

import collections
import select
import socket
import ssl
import time
from typing import Deque, List, NamedTuple, Optional

from commlib.transports.socket.framing import (ABORT, DATA, GOODBYE, FrameCodec, FrameError, decode_abort,
                                               decode_goodbye, encode_abort, encode_goodbye)

__all__ = ["Connection", "Outgoing", "Incoming", "Departure", "PeerGone", "BadFrame", "PREFETCH_BYTES", "drop_written"]

PREFETCH_BYTES = 64 << 10
_DRAIN_CHUNK = 256 << 10
_MAX_TAIL_BYTES = 256 << 20
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class Outgoing:
    """A send: ``view`` (bytes of the user's buffer) to ``peer``, as message ``step`` of ``seq``."""

    __slots__ = ("view", "total", "peer", "seq", "step", "label", "offset", "pieces", "started", "done",
                 "pending", "frame_sent")

    def __init__(self, view: memoryview, peer: int, seq: int, step: int, label: str, pending):
        self.view, self.total, self.peer = view, len(view), peer
        self.seq, self.step, self.label = seq, step, label
        self.offset = 0  # payload bytes put into frames so far
        self.pieces: List[memoryview] = []  # what is left to write of the current frame
        self.started = self.done = False
        self.frame_sent = 0  # bytes of the current frame written (a frame once begun must be finished)
        self.pending = pending


class Incoming:
    """A receive into ``view`` from ``peer``, as message ``step`` of ``seq``."""

    __slots__ = ("view", "total", "peer", "seq", "step", "label", "received", "done", "pending")

    def __init__(self, view: memoryview, peer: int, seq: int, step: int, label: str, pending):
        self.view, self.total, self.peer = view, len(view), peer
        self.seq, self.step, self.label = seq, step, label
        self.received = 0
        self.done = False
        self.pending = pending


def drop_written(pieces: List[memoryview], sent: int) -> None:
    """``sent`` bytes of ``pieces`` (the views a ``sendmsg`` was given) went out: drop them."""
    while sent:
        first = pieces[0]
        if sent >= len(first):
            sent -= len(first)
            del pieces[0]
        else:
            pieces[0] = first[sent:]
            sent = 0


def _advance(message: Outgoing, sent: int) -> None:
    """``sent`` more bytes of ``message``'s current frame were written."""
    message.frame_sent += sent
    drop_written(message.pieces, sent)


class Departure(NamedTuple):
    """How a peer's side of the connection ended: ``kind`` is "goodbye" (after collective
    ``last_seq``), "exited" (closed at a frame boundary), "cut" (closed mid-frame), "reset", or
    "abort" (``culprit``, ``abort_kind`` and ``text`` from its ABORT)."""

    kind: str
    last_seq: int = -1
    culprit: int = -1
    abort_kind: int = 0
    text: str = ""

    @property
    def urgent(self) -> bool:
        """Whether the group is broken whatever is posted: the peer gave up, or left a frame half sent."""
        return self.kind in ("abort", "cut", "reset")


class PeerGone(Exception):
    """The peer left (see :class:`Departure`) and something posted can never complete."""

    def __init__(self, connection: "Connection", departure: Departure):
        super().__init__(departure.kind)
        self.connection, self.departure = connection, departure


class BadFrame(Exception):
    """The peer sent a frame this rank did not expect: ``collective`` says whether it is a frame
    of another collective or size (the ranks disagree) rather than a corrupt stream."""

    def __init__(self, connection: "Connection", collective: bool, text: str):
        super().__init__(text)
        self.connection, self.collective, self.text = connection, collective, text


class Connection:
    def __init__(self, sock: socket.socket, peer: int, host: str, codec: FrameCodec):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer, self.host = peer, host
        self.codec = codec
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.header_bytes = codec.header_bytes
        self.send_queue: Deque[Outgoing] = collections.deque()
        self.recv_queue: Deque[Incoming] = collections.deque()
        # Message numbers per collective, in posting order (what ``step`` in a frame checks).
        self.send_seq = self.recv_seq = -1
        self.send_step = self.recv_step = 0
        self.header = bytearray(self.header_bytes)
        self.header_view = memoryview(self.header)
        self.header_have = 0
        self.frame_left = 0  # payload bytes of the current data frame still to read
        self.control: Optional[list] = None  # [kind, payload bytearray, bytes read]
        self.parked = False
        # Receives of at most this many bytes read header and payload in one call (one frame).
        self.prefetch_limit = min(PREFETCH_BYTES, codec.frame_bytes)
        self.bounce = bytearray(self.header_bytes + PREFETCH_BYTES)
        self.bounce_view = memoryview(self.bounce)
        self.pre: memoryview = self.bounce_view  # buffered bytes not yet consumed: pre[pre_pos:pre_end]
        self.pre_pos = self.pre_end = 0
        self.eof = False
        self.reset = False
        self.goodbye_seq = -1
        self.departure: Optional[Departure] = None
        self.interest = 0

    def describe(self) -> str:
        return f"rank {self.peer} (host {self.host})"

    # -- numbering ---------------------------------------------------------------------------
    def next_send_step(self, seq: int) -> int:
        if seq != self.send_seq:
            self.send_seq, self.send_step = seq, 0
        self.send_step += 1
        return self.send_step - 1

    def next_recv_step(self, seq: int) -> int:
        if seq != self.recv_seq:
            self.recv_seq, self.recv_step = seq, 0
        self.recv_step += 1
        return self.recv_step - 1

    # -- sending -----------------------------------------------------------------------------
    def queue_send(self, message: Outgoing) -> None:
        self.send_queue.append(message)
        if len(self.send_queue) == 1:
            self.pump_send()

    def _start_frame(self, message: Outgoing) -> None:
        length = min(self.codec.frame_bytes, message.total - message.offset)
        header = self.codec.data_header(message.seq, message.step, message.offset, length, message.total)
        pieces = [memoryview(header)]
        if length:
            pieces.append(message.view[message.offset:message.offset + length])
        message.pieces = pieces
        message.offset += length
        message.started = True
        message.frame_sent = 0

    def pump_send(self) -> None:
        """Write what the socket takes now; PeerGone when the peer can no longer receive."""
        queue = self.send_queue
        while queue:
            message = queue[0]
            if not message.pieces:
                if message.started and message.offset == message.total:
                    queue.popleft()
                    message.done = True
                    message.pending.remaining -= 1
                    continue
                self._start_frame(message)
            if self.departure is not None or self.eof:
                raise PeerGone(self, self.departure or self._ended())
            try:
                sent = self.sock.send(message.pieces[0]) if self.tls else self.sock.sendmsg(message.pieces)
            except _WOULD_BLOCK:
                return
            except OSError:
                self.reset = self.eof = True
                raise PeerGone(self, self._ended()) from None
            _advance(message, sent)

    def resume_send(self, message: Outgoing, sent: int) -> None:
        """Queue ``message`` (a one-frame message, the queue empty) of which ``sent`` bytes of its
        frame, header first, went out already (see :meth:`send_frame_now`), and write on."""
        self._start_frame(message)
        _advance(message, sent)
        self.queue_send(message)

    # -- the fast path's direct exchange (commlib/transports/socket/fast_path.py) -------------
    def quiet(self) -> bool:
        """Nothing queued, buffered or half read but a header the engine read ahead (parked, see
        :meth:`read_parked_frame_now`, or in part: the fast path then hands the receive to the
        engine), and the peer still there: a frame may go to the socket directly, and come from
        it, the state machines left as they are."""
        return not (self.send_queue or self.recv_queue or self.frame_left or self.control is not None
                    or self.pre_pos < self.pre_end or self.eof or self.tls or self.departure is not None)

    def send_frame_now(self, header: bytes, view: memoryview) -> int:
        """Write one frame (``header`` then ``view``) as far as the socket takes it now, on a
        :meth:`quiet` connection: the bytes written (0 if none; the queue then finishes it,
        :meth:`resume_send`, and meets any error of the socket itself)."""
        try:
            return self.sock.sendmsg((header, view))
        except OSError:  # would block, or the peer is gone: the engine's path finds out which
            return 0

    def read_frame_now(self, expected: bytes, payload: int) -> int:
        """On a :meth:`quiet` connection, read at most one frame of ``payload`` bytes (at most
        ``prefetch_limit``) into the bounce buffer: 1 when it is all there with the header
        ``expected`` (the payload at ``bounce[header_bytes:]``), 0 when nothing has arrived, -1
        when something else did (part of a frame, another frame, the end): it is kept as
        buffered bytes, where the receive queue reads first."""
        count = self._prefetch(payload)
        if count < 0:
            return 0
        if count == self.header_bytes + payload and self.bounce_view[:self.header_bytes] == expected:
            self.pre_pos = self.pre_end = 0
            return 1
        return -1

    def read_parked_frame_now(self, expected: bytes, payload: int) -> int:
        """A header is parked (the engine read ahead, see the module docstring): when it is
        ``expected``, read its ``payload`` bytes now, into the bounce buffer behind a copy of the
        header. 1 when they are all there; else -1: a header not expected stays parked, and a
        payload not all there yet is kept, with the header, as buffered bytes (nothing read is
        lost: the receive queue reads those first). The caller updates the epoll interest."""
        if self.header != expected:
            return -1
        header_bytes = self.header_bytes
        self.header_have, self.parked = 0, False
        self.bounce_view[:header_bytes] = self.header_view
        count = self._read(self.bounce_view[header_bytes:header_bytes + payload])
        if count == payload:
            return 1
        self.pre, self.pre_pos, self.pre_end = self.bounce_view, 0, header_bytes + max(count, 0)
        return -1

    def at_frame_boundary(self) -> bool:
        """No frame is half written: a control frame may go next."""
        return not self.send_queue or not self.send_queue[0].pieces or self.send_queue[0].frame_sent == 0

    def send_control(self, kind: int, payload: bytes, deadline: float) -> bool:
        """Drop queued sends and write a control frame (blocking until ``deadline``); False when
        it could not be (a frame is half written, or the socket did not take it in time)."""
        if not self.at_frame_boundary() or (self.departure is not None and self.departure.kind != "goodbye"):
            return False
        self.send_queue.clear()
        data = memoryview(self.codec.control_frame(kind, payload))
        while data:
            try:
                sent = self.sock.send(data)
                data = data[sent:]
            except _WOULD_BLOCK:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                select.select([], [self.sock], [], remaining)
            except OSError:
                return False
        return True

    def send_goodbye(self, last_seq: int, deadline: float) -> bool:
        return self.send_control(GOODBYE, encode_goodbye(last_seq), deadline)

    def send_abort(self, culprit: int, kind: int, text: str, deadline: float) -> bool:
        return self.send_control(ABORT, encode_abort(culprit, kind, text), deadline)

    # -- receiving ---------------------------------------------------------------------------
    def _read(self, view: memoryview) -> int:
        """Bytes read into ``view`` (from the buffered bytes first): >0, 0 at EOF, -1 if none now."""
        if self.pre_pos < self.pre_end:
            count = min(len(view), self.pre_end - self.pre_pos)
            view[:count] = self.pre[self.pre_pos:self.pre_pos + count]
            self.pre_pos += count
            return count
        if self.eof:
            return 0
        try:
            count = self.sock.recv_into(view)
        except _WOULD_BLOCK:
            return -1
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            count = 0
        except OSError:
            self.reset = True
            count = 0
        if not count:
            self.eof = True
        return count

    def _prefetch(self, payload: int) -> int:
        """Read up to one small frame (header and ``payload``) into the bounce buffer in one call."""
        try:
            count = self.sock.recv_into(self.bounce_view, self.header_bytes + payload)
        except _WOULD_BLOCK:
            return -1
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            count = 0
        except OSError:
            self.reset = True
            count = 0
        if not count:
            self.eof = True
            return 0
        self.pre, self.pre_pos, self.pre_end = self.bounce_view, 0, count
        return count

    def pump_recv(self) -> None:
        """Read what has arrived into the posted receives, in order; park a frame that came
        early. PeerGone when a posted receive can never complete; BadFrame on a frame that does
        not match it."""
        header_bytes = self.header_bytes
        queue = self.recv_queue
        while True:
            if self.frame_left:
                message = queue[0]
                start = message.received
                count = self._read(message.view[start:start + self.frame_left])
                if count <= 0:
                    return self._stalled(count)
                message.received += count
                self.frame_left -= count
                if not self.frame_left:
                    self._frame_read(message)
                continue
            if self.control is not None:
                if not self._read_control():
                    return None
                continue
            if self.header_have < header_bytes:
                if self.header_have == 0 and queue and self.pre_pos >= self.pre_end and not self.eof:
                    message = queue[0]
                    want = message.total - message.received
                    if want <= self.prefetch_limit:
                        count = self._prefetch(want)
                        if count <= 0:
                            return self._stalled(count)
                        # The common small message: the whole frame in one read, its header the one
                        # expected (one compare checks job, group, sequence, step, offset, size).
                        if count == header_bytes + want and self.bounce_view[:header_bytes] == self._expected(message):
                            message.view[message.received:] = self.bounce_view[header_bytes:count]
                            message.received = message.total
                            self.pre_pos = self.pre_end = 0
                            self.parked = False
                            self._frame_read(message)
                            continue
                count = self._read(self.header_view[self.header_have:])
                if count <= 0:
                    return self._stalled(count)
                self.header_have += count
                continue
            if queue and self.header == self._expected(queue[0]):
                message = queue[0]
                self.parked = False
                self.header_have = 0
                self.frame_left = min(self.codec.frame_bytes, message.total - message.received)
                if not self.frame_left:
                    self._frame_read(message)
                continue
            # Not the frame the posted receive expects (or none is posted): find out what it is.
            try:
                frame = self.codec.parse(self.header)
            except FrameError as error:
                raise BadFrame(self, False, f"{self.describe()} sent {error}") from None
            if frame.type != DATA:
                self.header_have = 0
                self.control = [frame.type, bytearray(frame.length), 0]
                continue
            if not queue:
                self.parked = True  # its receive is not posted yet: leave the payload in the kernel
                return None
            message = queue[0]
            problem = self.codec.mismatch(frame, message.seq, message.step, message.received, message.total)
            raise BadFrame(self, problem[0] if problem else False,
                           f"{self.describe()} sent {problem[1] if problem else 'an unexpected frame header'}")

    def _expected(self, message: Incoming) -> bytes:
        """The header of the next frame of ``message``, as its sender builds it."""
        length = min(self.codec.frame_bytes, message.total - message.received)
        return self.codec.data_header(message.seq, message.step, message.received, length, message.total)

    def _frame_read(self, message: Incoming) -> None:
        if message.received == message.total:
            self.recv_queue.popleft()
            message.done = True
            message.pending.remaining -= 1

    def _read_control(self) -> bool:
        """Read the current control frame's payload; act on it once whole. False: not yet."""
        assert self.control is not None
        kind, payload, have = self.control
        while have < len(payload):
            count = self._read(memoryview(payload)[have:])
            if count <= 0:
                self.control[2] = have
                self._stalled(count)
                return False
            have += count
        self.control = None
        try:
            if kind == GOODBYE:
                self.goodbye_seq = decode_goodbye(bytes(payload))
                return True
            culprit, abort_kind, text = decode_abort(bytes(payload))
        except FrameError as error:
            raise BadFrame(self, False, f"{self.describe()} sent {error}") from None
        self.departure = Departure("abort", self.goodbye_seq, culprit, abort_kind, text)
        raise PeerGone(self, self.departure)

    def _stalled(self, count: int) -> None:
        """Nothing more to read now (-1) or ever (0: EOF, the tail consumed)."""
        if count < 0:
            return None
        if self.departure is None:
            self.departure = self._ended()
        if self.recv_queue or self.departure.urgent:
            raise PeerGone(self, self.departure)
        return None

    def _ended(self) -> Departure:
        if self.reset:
            return Departure("reset", self.goodbye_seq)
        if self.frame_left or self.control is not None or 0 < self.header_have:
            if not (self.header_have == self.header_bytes and self.parked):
                return Departure("cut", self.goodbye_seq)
        if self.goodbye_seq >= 0:
            return Departure("goodbye", self.goodbye_seq)
        return Departure("exited")

    # -- the peer's side closed ----------------------------------------------------------------
    def on_hangup(self) -> None:
        """The peer closed (or reset) its side: keep what it sent, learn how it left, then consume
        what can be. PeerGone when the group is broken (see :attr:`Departure.urgent`)."""
        tail = bytearray(self.pre[self.pre_pos:self.pre_end])
        chunk = bytearray(_DRAIN_CHUNK)
        while not self.eof and len(tail) < _MAX_TAIL_BYTES:
            try:
                count = self.sock.recv_into(chunk)
            except _WOULD_BLOCK:
                break
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                count = 0
            except OSError:
                self.reset = True
                count = 0
            if not count:
                self.eof = True
                break
            tail += chunk[:count]
        self.pre, self.pre_pos, self.pre_end = memoryview(tail), 0, len(tail)
        if self.eof and self.departure is None:
            self.departure = self._scan_tail()
        self.pump_recv()
        if self.departure is not None and self.departure.urgent:
            raise PeerGone(self, self.departure)

    def _scan_tail(self) -> Departure:
        """How the peer left, from the state of the stream and the frames in the tail (not consumed)."""
        data, position, end = self.pre, self.pre_pos, self.pre_end
        skip = self.frame_left
        header = bytes(self.header[:self.header_have])
        goodbye = self.goodbye_seq
        if self.control is not None:
            kind, payload, have = self.control
            need = len(payload) - have
            if end - position < need:
                return Departure("cut", goodbye)
            body = bytes(payload[:have]) + bytes(data[position:position + need])
            position += need
            try:
                if kind == ABORT:
                    return Departure("abort", goodbye, *decode_abort(body))
                goodbye = decode_goodbye(body)
            except FrameError:
                return Departure("cut", goodbye)
        while True:
            position += skip
            if position > end:
                return Departure("cut", goodbye)
            take = self.header_bytes - len(header)
            header += bytes(data[position:position + take])
            position += min(take, end - position)
            if len(header) < self.header_bytes:
                if header:
                    return Departure("cut", goodbye)
                if self.reset:
                    return Departure("reset", goodbye)
                return Departure("goodbye", goodbye) if goodbye >= 0 else Departure("exited")
            try:
                frame = self.codec.parse(header)
            except FrameError:
                return Departure("cut", goodbye)
            header = b""
            if frame.type == DATA:
                skip = frame.length
                continue
            body = bytes(data[position:position + frame.length])
            if len(body) < frame.length:
                return Departure("cut", goodbye)
            position += frame.length
            skip = 0
            try:
                if frame.type == ABORT:
                    return Departure("abort", goodbye, *decode_abort(body))
                goodbye = decode_goodbye(body)
            except FrameError:
                return Departure("cut", goodbye)

    def close(self, linger_until: float = 0.0) -> None:
        """Close the socket, reading what is left first (unread bytes would make the close a reset,
        and a reset makes the peer drop what it has not read yet: our ABORT). Until ``linger_until``
        (a ``time.monotonic()``), keep reading until the peer closes its side too: after a failure
        the peer may still be sending the collective's bytes until our ABORT reaches it."""
        try:
            self.sock.setblocking(False)
            chunks = 0
            while True:
                try:
                    if not self.sock.recv(_DRAIN_CHUNK):
                        break  # the peer closed its side: nothing more can come
                    chunks += 1
                    if chunks >= 64 and time.monotonic() >= linger_until:
                        break
                except BlockingIOError:
                    left = linger_until - time.monotonic()
                    if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                        break
        except (OSError, ValueError):
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown_writes(self) -> None:
        """Send the peer a FIN after what was written (over TLS too: no close_notify, which would
        block; the frames say all there is to say)."""
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_WR)
        except OSError:
            pass
