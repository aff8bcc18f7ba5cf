"""The point-to-point engine over a real socket pair, with the test playing the peer frame by frame.

What a rank's channel must survive from its peer, and what it must never do to its caller: a
receive that gave up takes no later byte; a send that gave up mid-message tells the receiver how
much went; sizes a header announces allocate nothing; a frame no commlib peer sends breaks that
connection with an error naming the peer; hypothesis cuts streams of frames at arbitrary points
and mixes in arbitrary bytes, and every message still arrives whole and exact, or a named error
ends the receive - never a write outside the posted buffer.
"""

import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commlib.errors import CommError, CommTimeoutError, PeerExitedError
from commlib.transports.socket.p2p_engine import P2PEngine
from commlib.transports.socket.p2p_framing import (CANCEL, CTS, DATA, DECLINE, EAGER, GOODBYE, HEADER_BYTES, RTS,
                                                   FrameError, P2PCodec)
from commlib.transports.socket.p2p_link import P2PLink
from commlib.transports.socket.p2p_matching import ANY_SOURCE, P2POp
from tests.support.raw_socket import read_exactly

JOB, GROUP = b"j" * 8, b"g" * 8
EAGER_LIMIT, FRAME = 1024, 4096
GUARD = 16


class Peer:
    """Rank 1, played by the test over one end of a socket pair; rank 0's engine has the other."""

    def __init__(self, **engine_options):
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.codec = P2PCodec(JOB, GROUP, EAGER_LIMIT, FRAME)
        self.engine = P2PEngine(0, [None, P2PLink(theirs, 1, "peer-host", self.codec)], name="test", **engine_options)

    def write(self, kind, message, tag=0, payload=b"", offset=0, total=None, codec=None):
        total = len(payload) if total is None else total
        self.sock.sendall((codec or self.codec).header(kind, message, tag, len(payload), offset, total) + payload)

    def read_frame(self, timeout=10.0):
        self.sock.settimeout(timeout)
        header = self._exactly(HEADER_BYTES)
        frame = self.codec.parse(header)
        return frame, self._exactly(frame.length)

    def _exactly(self, count):
        return read_exactly(self.sock, count)

    def post(self, kind, nbytes, tag=0, timeout=10.0, peer=1, fill=0, on_done=None):
        buf = bytearray([fill]) * (nbytes + GUARD)  # a guard after the posted bytes: nothing may land there
        number = self.engine.next_number()
        op = P2POp(kind, memoryview(buf)[:nbytes], peer, tag, timeout, f"rank 0: {kind} #{number}", number, on_done)
        return self.engine.post(op), buf

    def close(self):
        self.engine.close()
        self.sock.close()


@pytest.fixture
def peer():
    made = Peer()
    yield made
    made.close()


def until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the engine did not get there"
        time.sleep(0.01)


def ended(op, seconds=10.0):
    assert op.event.wait(seconds), f"{op.what} did not end"
    return op.error


def test_a_receive_that_gave_up_mid_message_takes_no_later_byte(peer):
    op, buf = peer.post("recv", 4 * FRAME, tag=3, timeout=0.5)
    peer.write(RTS, 1, tag=3, total=4 * FRAME)
    frame, _ = peer.read_frame()
    assert (frame.type, frame.message) == (CTS, 1)
    peer.write(DATA, 1, payload=b"\xaa" * FRAME, total=4 * FRAME)
    error = ended(op)
    assert isinstance(error, CommTimeoutError) and "of which 4 KiB arrived; the rest is dropped" in str(error), error
    for index in range(1, 4):  # the rest of the message comes after the receive gave up
        peer.write(DATA, 1, payload=b"\xbb" * FRAME, offset=index * FRAME, total=4 * FRAME)
    peer.write(EAGER, 2, tag=4, payload=b"12345678")
    after, small = peer.post("recv", 8, tag=4)
    assert ended(after) is None and bytes(small[:8]) == b"12345678"
    assert bytes(buf[:FRAME]) == b"\xaa" * FRAME and bytes(buf[FRAME:]) == bytes(3 * FRAME + GUARD)
    assert not peer.engine.discarding and not peer.engine.incoming


def test_a_send_that_gave_up_mid_message_finishes_its_frame_and_says_how_much_went(peer):
    nbytes = 32 << 20  # far more than the socket pair's buffers: the peer reads nothing meanwhile
    op, _ = peer.post("send", nbytes, tag=7, timeout=0.5, fill=1)
    frame, _ = peer.read_frame()
    assert (frame.type, frame.tag, frame.total) == (RTS, 7, nbytes)
    peer.write(CTS, frame.message)
    error = ended(op)
    assert isinstance(error, CommTimeoutError) and "of 32 MiB sent; rank 1's receive is told it fails" in str(error)
    received = 0
    while True:
        frame, payload = peer.read_frame()
        if frame.type == CANCEL:
            break
        assert frame.type == DATA and frame.offset == received and payload == b"\x01" * frame.length
        received += frame.length
    assert frame.offset == received and 0 < received < nbytes, (frame, received)


def test_a_send_withdrawn_before_any_byte_went_lets_the_receive_take_the_next_message(peer):
    op, buf = peer.post("recv", 2 * FRAME, tag=5)
    peer.write(RTS, 1, tag=5, total=2 * FRAME)
    assert peer.read_frame()[0].type == CTS
    peer.write(CANCEL, 1)  # the send timed out on its side before a byte went: as if never matched
    peer.write(RTS, 2, tag=5, total=2 * FRAME)
    frame, _ = peer.read_frame()
    assert (frame.type, frame.message) == (CTS, 2)
    peer.write(DATA, 2, payload=b"\x02" * FRAME, total=2 * FRAME)
    peer.write(DATA, 2, payload=b"\x03" * FRAME, offset=FRAME, total=2 * FRAME)
    assert ended(op) is None and op.source == 1
    assert bytes(buf) == b"\x02" * FRAME + b"\x03" * FRAME + bytes(GUARD)


def test_a_withdrawal_after_some_bytes_fails_the_receive_naming_them(peer):
    op, _ = peer.post("recv", 2 * FRAME, tag=5)
    peer.write(RTS, 1, tag=5, total=2 * FRAME)
    peer.read_frame()
    peer.write(DATA, 1, payload=b"\x02" * FRAME, total=2 * FRAME)
    peer.write(CANCEL, 1, offset=FRAME, total=FRAME)
    error = ended(op)
    assert isinstance(error, CommError) and "rank 1 withdrew the message after 4 KiB of 8 KiB" in str(error), error


def test_a_held_announcement_withdrawn_is_forgotten(peer):
    peer.write(RTS, 1, tag=5, total=2 * FRAME)
    peer.write(CANCEL, 1)
    peer.write(EAGER, 2, tag=5, payload=b"x" * 10)
    until(lambda: [held.message for held in peer.engine.held] == [2])  # read before the receive is posted
    op, buf = peer.post("recv", 10, tag=5)
    assert ended(op) is None and bytes(buf[:10]) == b"x" * 10


def test_a_100_gb_announcement_allocates_nothing_and_fails_the_receive_on_its_size(peer):
    op, buf = peer.post("recv", 8, tag=1)
    peer.write(RTS, 1, tag=1, total=100 << 30)
    error = ended(op)
    assert isinstance(error, CommError) and "does not fit the receive buffer of 8 B: rank 1 sent 100 GiB" in str(error)
    frame, _ = peer.read_frame()
    assert (frame.type, frame.message) == (DECLINE, 1)
    assert bytes(buf) == bytes(8 + GUARD) and peer.engine.held_bytes == 0


def test_a_declined_send_is_complete(peer):
    op, _ = peer.post("send", 2 * FRAME, tag=2)
    frame, _ = peer.read_frame()
    peer.write(DECLINE, frame.message)
    assert ended(op) is None


@pytest.mark.parametrize("bad,needle", [
    (("header", EAGER, 1, 0, EAGER_LIMIT + 1), "above the eager limit of 1 KiB"),
    (("header", DATA, 9, 0, 100), "sent data of message 9, which no receive here matched"),
    (("job",), "a frame of another job"),
    (("garbage",), "not a commlib point-to-point frame"),
])
def test_a_frame_no_peer_sends_breaks_the_connection_naming_the_peer(peer, bad, needle):
    op, buf = peer.post("recv", 8, tag=0)
    if bad[0] == "header":
        kind, message, tag, length = bad[1:]
        peer.sock.sendall(peer.codec.header(kind, message, tag, length, 0, length) + b"z" * min(length, 64))
    elif bad[0] == "job":
        peer.write(EAGER, 1, payload=b"12345678", codec=P2PCodec(b"other-jb", GROUP, EAGER_LIMIT, FRAME))
    else:
        peer.sock.sendall(b"GET / HTTP/1.1\r\n" * 8)
    error = ended(op)
    assert isinstance(error, CommError) and needle in str(error) and "rank 1 (host peer-host)" in str(error), error
    assert bytes(buf) == bytes(8 + GUARD)
    peer.sock.settimeout(5)
    assert peer.sock.recv(100) == b""  # this rank closed the connection
    later, _ = peer.post("recv", 8, tag=0)
    assert isinstance(ended(later), PeerExitedError)


@pytest.mark.parametrize("how,needle", [("goodbye", "rank 1 (host peer-host) closed its group"),
                                        ("cut", "rank 1 exited in the middle of a message"),
                                        ("close", "rank 1 exited (host peer-host: its connection closed)")])
def test_a_peer_that_leaves_is_named_by_every_wait_for_it(peer, how, needle):
    waiting, _ = peer.post("recv", 8, tag=0)
    any_source, _ = peer.post("recv", 8, tag=0, peer=ANY_SOURCE)
    if how == "goodbye":
        peer.write(GOODBYE, 0)
    elif how == "cut":
        peer.sock.sendall(peer.codec.header(EAGER, 1, 9, 100, 0, 100) + b"z" * 10)
    peer.sock.close()
    for op in (waiting, any_source):
        error = ended(op)
        assert isinstance(error, PeerExitedError), error
    assert needle in str(waiting.error) and "every other rank exited" in str(any_source.error)
    send, _ = peer.post("send", 8)
    assert isinstance(ended(send), PeerExitedError) and needle in str(send.error)


def test_messages_a_peer_sent_before_it_left_are_still_received(peer):
    peer.write(EAGER, 1, tag=0, payload=b"a" * 8)
    peer.write(GOODBYE, 0)
    peer.sock.close()
    until(lambda: peer.engine.links[1].ended is not None)
    op, buf = peer.post("recv", 8, tag=0)
    assert ended(op) is None and bytes(buf[:8]) == b"a" * 8
    op, _ = peer.post("recv", 8, tag=0)
    assert isinstance(ended(op), PeerExitedError)


def test_a_timed_out_receive_names_what_waits_unreceived(peer):
    peer.write(EAGER, 1, tag=17, payload=b"a" * 8)
    until(lambda: len(peer.engine.held) == 1)
    op, _ = peer.post("recv", 8, tag=16, timeout=0.2)
    error = ended(op)
    assert isinstance(error, CommTimeoutError) and "1 message(s) with other tags (17) from it wait here" in str(error)


def test_a_callback_on_the_engines_thread_may_wait_for_another_operation(peer):
    seen = []

    def then_wait(first):  # runs on the engine's thread: the wait must run the engine itself
        second, buf = peer.post("recv", 4, tag=2)
        peer.engine.wait(second)
        seen.append((first.error, second.error, bytes(buf[:4])))

    peer.post("recv", 4, tag=1, on_done=then_wait)
    peer.write(EAGER, 1, tag=1, payload=b"one!")
    time.sleep(0.3)  # the callback waits meanwhile
    peer.write(EAGER, 2, tag=2, payload=b"two!")
    until(lambda: seen)
    assert seen == [(None, None, b"two!")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, EAGER_LIMIT), st.integers(0, 3)), min_size=1, max_size=12),
       st.lists(st.integers(1, 600), min_size=1, max_size=20), st.booleans())
def test_fuzz_eager_messages_arrive_whole_and_in_order_whatever_the_cuts(messages, cuts, post_first):
    peer = Peer()
    try:
        wire = b""
        for index, (size, tag) in enumerate(messages):
            body = bytes((index * 31 + k) % 251 for k in range(size))
            wire += peer.codec.header(EAGER, index + 1, tag, size, 0, size) + body
        posted = [peer.post("recv", size, tag) for size, tag in messages] if post_first else []
        position, index = 0, 0
        while position < len(wire):
            cut = cuts[index % len(cuts)]
            peer.sock.sendall(wire[position:position + cut])
            position += cut
            index += 1
        posted = posted or [peer.post("recv", size, tag) for size, tag in messages]
        for index, ((size, _), (op, buf)) in enumerate(zip(messages, posted)):
            assert ended(op) is None, op.error
            assert bytes(buf[:size]) == bytes((index * 31 + k) % 251 for k in range(size)) and bytes(buf[size:]) == \
                bytes(GUARD)
    finally:
        peer.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=3000), st.integers(0, 2))
def test_fuzz_arbitrary_bytes_end_a_receive_with_a_named_error_never_a_stray_write(noise, valid_first):
    peer = Peer()
    try:
        posted = [peer.post("recv", 64, tag, timeout=5.0) for tag in range(3)]
        for index in range(valid_first):  # some real messages first, then the noise
            peer.write(EAGER, index + 1, tag=index, payload=bytes([index + 1]) * 64)
        peer.sock.sendall(noise)
        peer.sock.shutdown(socket.SHUT_WR)  # a stream that ends after the noise (else: the timeout)
        for index, (op, buf) in enumerate(posted):
            error = ended(op, 15.0)
            if index < valid_first:
                assert error is None and bytes(buf) == bytes([index + 1]) * 64 + bytes(GUARD)
            else:
                assert isinstance(error, CommError), error
                assert bytes(buf[64:]) == bytes(GUARD)
    finally:
        peer.close()


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES))
def test_fuzz_headers_parse_or_are_refused(header):
    codec = P2PCodec(JOB, GROUP, EAGER_LIMIT, FRAME)
    for candidate in (header, b"CLPP" + header[4:8] + JOB + GROUP + header[24:]):
        try:
            frame = codec.parse(candidate)
        except FrameError:
            continue
        assert frame.offset + frame.length <= frame.total
        if frame.type == EAGER:
            assert frame.length == frame.total <= EAGER_LIMIT
        elif frame.type == DATA:
            assert 0 < frame.length <= FRAME
        else:
            assert frame.length == 0
