"""One peer's connection of a point-to-point channel: its queue of frames out, its frames in.

Out: a FIFO of :class:`Chunk` (a header and maybe payload, written with one ``sendmsg`` straight
from the user's buffer). A large message's DATA frames come from a :class:`Stream`, one frame at
a time: after each frame the stream goes to the back of the queue, so a long transfer delays the
small frames queued behind it by one frame, not by the whole message.

In: a header is read into the link's own 56 bytes, then handed to the channel's dispatcher
(:meth:`Dispatcher.on_frame`), which says where its payload goes: a user's buffer (read with
``recv_into``, no copy), a buffer of held bytes, nowhere (read and dropped), or *not yet* - the
link is then *parked*: the header stays here, the payload stays in the kernel (TCP holds the
peer back) until :meth:`unpark`. When the stream ends the dispatcher learns how
(:meth:`Dispatcher.on_end`): after a GOODBYE, at a frame boundary, in the middle of a frame, or
by a reset.
"""

from __future__ import annotations

import collections
import socket
import ssl
from typing import Callable, Deque, List, Optional, Protocol

from commlib.transports.socket.connection import drop_written
from commlib.transports.socket.p2p_framing import DATA, HEADER_BYTES, FrameError, P2PCodec, P2PFrame

__all__ = ["P2PLink", "Chunk", "Stream", "Sink", "Dispatcher", "LinkBroken", "PARK"]

_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_DISCARD_BYTES = 64 << 10


class LinkBroken(Exception):
    """The connection cannot be used any more (a header that does not parse, a failed write)."""


class Sink:
    """Where the payload of the frame being read goes: ``view`` (None: dropped), then ``done(link)``."""

    __slots__ = ("view", "done", "owner")

    def __init__(self, view: Optional[memoryview], done: Optional[Callable[["P2PLink"], None]] = None, owner=None):
        self.view, self.done, self.owner = view, done, owner


#: What the dispatcher returns for a frame whose payload must wait in the kernel.
PARK = Sink(None)


class Dispatcher(Protocol):
    def on_frame(self, link: "P2PLink", frame: P2PFrame) -> Optional[Sink]:
        """A frame's header arrived: a Sink for its payload (frames without payload: None), or PARK."""

    def on_end(self, link: "P2PLink", how: str) -> None:
        """The stream ended: ``how`` is "goodbye", "exited", "cut" or "reset"."""


class Chunk:
    """Bytes to write: ``pieces`` (views); ``written(link)`` runs once the last byte went."""

    __slots__ = ("pieces", "sent", "written", "owner", "stream")

    def __init__(self, pieces: List, written: Optional[Callable[["P2PLink"], None]] = None, owner=None,
                 stream: Optional["Stream"] = None):
        self.pieces, self.sent, self.written, self.owner, self.stream = pieces, 0, written, owner, stream


class Stream:
    """The DATA frames of message ``message`` (``view``, from byte ``offset``); ``finished(link)`` once all went."""

    __slots__ = ("message", "view", "offset", "sent", "owner", "finished", "stopped")

    def __init__(self, message: int, view: memoryview, owner, finished: Callable[["P2PLink"], None]):
        self.message, self.view, self.owner, self.finished = message, view, owner, finished
        self.offset = 0  # bytes put into frames so far
        self.sent = 0  # bytes whose frames were written whole
        self.stopped = False


class P2PLink:
    def __init__(self, sock: socket.socket, peer: int, host: str, codec: P2PCodec):
        self.sock = sock
        sock.setblocking(False)
        self.fd = sock.fileno()
        self.peer, self.host = peer, host
        self.codec = codec
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.out: Deque[Chunk] = collections.deque()
        self.next_message = 0  # ids of the messages this end sends
        self.header = bytearray(HEADER_BYTES)
        self.header_view = memoryview(self.header)
        self.header_have = 0
        self.frame: Optional[P2PFrame] = None  # whose payload is being read (or waits, parked)
        self.sink: Optional[Sink] = None
        self.sink_at = 0
        self.parked = False
        self.goodbye = False
        self.ended: Optional[str] = None  # how the peer's stream ended, once it did
        self.interest = 0
        self._discard = bytearray(_DISCARD_BYTES)

    def describe(self) -> str:
        return f"rank {self.peer} (host {self.host})"

    def new_message_id(self) -> int:
        self.next_message += 1
        return self.next_message

    # -- out ---------------------------------------------------------------------------------
    def queue(self, chunk: Chunk) -> None:
        self.out.append(chunk)

    def queue_stream(self, stream: Stream) -> None:
        self.out.append(self._stream_chunk(stream))

    def _stream_chunk(self, stream: Stream) -> Chunk:
        length = min(self.codec.frame_bytes, len(stream.view) - stream.offset)
        header = self.codec.header(DATA, stream.message, 0, length, stream.offset, len(stream.view))
        pieces = [memoryview(header), stream.view[stream.offset:stream.offset + length]]
        stream.offset += length
        return Chunk(pieces, None, stream.owner, stream)

    def started(self, chunk: Chunk) -> bool:
        """Whether some but not all of ``chunk`` went out (only the queue's head can be)."""
        return bool(self.out) and self.out[0] is chunk and chunk.sent > 0

    def pump_send(self) -> None:
        """Write what the socket takes now; LinkBroken when it cannot be written any more."""
        out = self.out
        while out:
            chunk = out[0]
            try:
                sent = self.sock.send(chunk.pieces[0]) if self.tls else self.sock.sendmsg(chunk.pieces)
            except _WOULD_BLOCK:
                return
            except OSError as error:
                raise LinkBroken(f"writing to {self.describe()} failed ({error.strerror or error})") from None
            chunk.sent += sent
            pieces = chunk.pieces
            drop_written(pieces, sent)
            while pieces and not len(pieces[0]):
                del pieces[0]
            if pieces:
                continue
            out.popleft()
            stream = chunk.stream
            if stream is not None:
                if stream.stopped:
                    continue
                stream.sent = stream.offset
                if stream.offset < len(stream.view):
                    out.append(self._stream_chunk(stream))  # round robin with what else waits
                else:
                    stream.finished(self)
            elif chunk.written is not None:
                chunk.written(self)

    def drop(self, owner) -> Optional[Chunk]:
        """Remove ``owner``'s chunks that have not started; the started one (if any) is returned
        with its rest copied (the owner's buffer is no longer read) and no callback."""
        started = None
        kept: Deque[Chunk] = collections.deque()
        for index, chunk in enumerate(self.out):
            if chunk.owner is not owner:
                kept.append(chunk)
            elif index == 0 and chunk.sent:
                chunk.pieces = [memoryview(b"".join(bytes(piece) for piece in chunk.pieces))]
                chunk.written, chunk.owner = None, None
                if chunk.stream is not None:
                    chunk.stream.stopped = True
                started = chunk
                kept.append(chunk)
            elif chunk.stream is not None:
                chunk.stream.stopped = True
        self.out = kept
        return started

    # -- in ----------------------------------------------------------------------------------
    def pump_recv(self, dispatcher: Dispatcher) -> None:
        """Read what arrived; the dispatcher hears of every frame. LinkBroken on a bad header."""
        while self.ended is None:
            if self.frame is not None and self.sink is not None:
                outcome = self._read_payload()
                if outcome <= 0:
                    if outcome == 0:
                        self._end(dispatcher)
                    return
                continue
            if self.parked:
                return
            count = self._read(self.header_view[self.header_have:])
            if count <= 0:
                if count == 0:
                    self._end(dispatcher)
                return
            self.header_have += count
            if self.header_have < HEADER_BYTES:
                continue
            self.header_have = 0
            try:
                frame = self.codec.parse(self.header)
            except FrameError as error:
                raise LinkBroken(f"{self.describe()} sent {error}") from None
            self._dispatch(dispatcher, frame)

    def _dispatch(self, dispatcher: Dispatcher, frame: P2PFrame) -> None:
        sink = dispatcher.on_frame(self, frame)
        if sink is PARK:
            self.frame, self.parked = frame, True
            return
        if frame.length:
            assert sink is not None
            self.frame, self.sink, self.sink_at = frame, sink, 0
            return
        if sink is not None and sink.done is not None:
            sink.done(self)

    def unpark(self, dispatcher: Dispatcher) -> None:
        """Offer the parked frame to the dispatcher again (a receive was posted, held bytes freed)."""
        if self.parked and self.frame is not None:
            frame, self.frame, self.parked = self.frame, None, False
            self._dispatch(dispatcher, frame)

    def discard_rest(self, owner) -> None:
        """The payload being read for ``owner`` goes nowhere from here (its receive gave up)."""
        if self.sink is not None and self.sink.owner is owner:
            self.sink = Sink(None, None, None)

    def _read_payload(self) -> int:
        """1: the frame's payload is in; -1: more to come; 0: the stream ended first."""
        frame, sink = self.frame, self.sink
        assert frame is not None and sink is not None
        while self.sink_at < frame.length:
            left = frame.length - self.sink_at
            if sink.view is None:
                count = self._read(memoryview(self._discard)[:min(left, _DISCARD_BYTES)])
            else:
                count = self._read(sink.view[self.sink_at:self.sink_at + left])
            if count <= 0:
                return count
            self.sink_at += count
        self.frame, self.sink = None, None
        if sink.done is not None:
            sink.done(self)
        return 1

    def _read(self, into: memoryview) -> int:
        """Bytes read into ``into``; -1 when nothing is there now, 0 at the end of the stream."""
        try:
            return self.sock.recv_into(into)
        except _WOULD_BLOCK:
            return -1
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            return 0
        except OSError:
            self.ended = "reset"
            return 0

    def _end(self, dispatcher: Dispatcher) -> None:
        if self.ended is None:
            if self.header_have or self.frame is not None:
                self.ended = "cut"
            else:
                self.ended = "goodbye" if self.goodbye else "exited"
        self.frame, self.sink, self.parked = None, None, False
        dispatcher.on_end(self, self.ended)

    def has_pending_tls(self) -> bool:
        """TLS may hold decrypted bytes that epoll cannot see (they left the socket already)."""
        return self.tls and self.ended is None and not self.parked and self.sock.pending() > 0  # type: ignore[attr-defined]

    # -- the end -----------------------------------------------------------------------------
    def close(self, goodbye: Optional[bytes]) -> None:
        """Best effort: the GOODBYE (if no frame is half written), a FIN, then close."""
        try:
            if goodbye is not None and (not self.out or not self.out[0].sent) and self.ended is None:
                self.sock.setblocking(True)
                self.sock.settimeout(0.2)
                self.sock.sendall(goodbye)
        except OSError:
            pass
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_WR)
        except OSError:
            pass
        try:
            self.sock.setblocking(False)
            for _ in range(16):
                if not self.sock.recv(_DISCARD_BYTES):
                    break
        except (OSError, ValueError):
            pass
        try:
            self.sock.close()
        except OSError:
            pass
