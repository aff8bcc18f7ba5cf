"""The socket transport's frames and its per-connection receive machine, over a real socket pair.

Hypothesis cuts the byte stream at arbitrary points (a header split in two, a payload in many
pieces, several frames in one read) and feeds arbitrary bytes: every message arrives whole and
exact, and anything else is a named refusal, never a write past the posted buffer.
"""

import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commlib.transports.socket.connection import BadFrame, Connection, Incoming, PeerGone
from commlib.transports.socket.framing import (ABORT, ABORT_EXITED, DATA, GOODBYE, FrameCodec, FrameError, encode_abort,
                                               encode_goodbye)

JOB, GROUP = b"j" * 8, b"g" * 8


class Counter:
    remaining = 0


def codec(checked=True, frame_bytes=4096):
    return FrameCodec(checked, JOB, GROUP, frame_bytes)


def frames(checked, payload: bytes, seq, step, frame_bytes):
    """The bytes a sender puts on the wire for one message (frames of at most ``frame_bytes``)."""
    c = codec(checked, frame_bytes)
    out = b""
    offset = 0
    while True:
        length = min(frame_bytes, len(payload) - offset)
        out += c.data_header(seq, step, offset, length, len(payload)) + payload[offset:offset + length]
        offset += length
        if offset >= len(payload):
            return out


def receiver(checked=True, frame_bytes=4096):
    left, right = socket.socketpair()
    right.setblocking(False)
    return left, Connection(right, 1, "peer-host", codec(checked, frame_bytes))


def post(connection, nbytes, seq, step):
    buf = bytearray(nbytes + 16)  # a guard after the posted bytes: nothing may land there
    pending = Counter()
    pending.remaining = 1
    message = Incoming(memoryview(buf)[:nbytes], 1, seq, step, "", pending)
    connection.recv_queue.append(message)
    return buf, message


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 9000), min_size=1, max_size=4), st.lists(st.integers(1, 700), min_size=1,
                                                                         max_size=30),
       st.booleans(), st.booleans())
def test_fuzz_messages_arrive_whole_whatever_the_cuts(sizes, cuts, checked, post_early):
    sender, connection = receiver(checked)
    rng = np.random.default_rng(len(sizes) * 7 + sum(cuts))
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]
    wire = b"".join(frames(checked, payload, 5, step, 4096) for step, payload in enumerate(payloads))
    posted = [post(connection, len(payload), 5, step) for step, payload in enumerate(payloads)] if post_early else []
    sender.setblocking(False)
    position, index = 0, 0
    while position < len(wire):
        cut = cuts[index % len(cuts)]
        try:
            position += sender.send(wire[position:position + cut])
        except BlockingIOError:  # the receiver holds the peer back (a parked frame): now it posts
            assert connection.parked
            posted = posted or [post(connection, len(payload), 5, step) for step, payload in enumerate(payloads)]
            connection.parked = False
        index += 1
        connection.pump_recv()
    if not posted:
        assert connection.parked
        posted = [post(connection, len(payload), 5, step) for step, payload in enumerate(payloads)]
        connection.parked = False
    for _ in range(len(wire) // 1000 + 10):
        connection.pump_recv()
    for (buf, message), payload in zip(posted, payloads):
        assert message.done and bytes(buf[:len(payload)]) == payload and bytes(buf[len(payload):]) == bytes(16)
    sender.close()
    connection.sock.close()


def test_a_frame_of_another_collective_step_or_size_is_refused_before_its_payload():
    for seq, step, total in ((6, 0, 8), (5, 1, 8), (5, 0, 9)):
        sender, connection = receiver()
        sender.sendall(frames(True, b"\xee" * total, seq, step, 4096))
        buf, _ = post(connection, 8, 5, 0)
        with pytest.raises(BadFrame) as refused:
            connection.pump_recv()
        assert refused.value.collective and "rank 1 (host peer-host)" in refused.value.text
        assert bytes(buf) == bytes(24), "not a byte of the payload may land"


def test_plain_frames_check_the_length_only():
    sender, connection = receiver(checked=False)
    sender.sendall(codec(False).data_header(0, 0, 0, 100 << 30, 0))
    buf, _ = post(connection, 8, 5, 0)
    with pytest.raises(BadFrame, match="100 GiB"):
        connection.pump_recv()
    assert bytes(buf) == bytes(24)


def test_a_goodbye_then_close_is_a_clean_departure_and_an_abort_says_why():
    sender, connection = receiver()
    sender.sendall(codec().control_frame(GOODBYE, encode_goodbye(41)))
    sender.shutdown(socket.SHUT_WR)
    connection.on_hangup()
    assert connection.departure.kind == "goodbye" and connection.departure.last_seq == 41
    post(connection, 8, 42, 0)
    with pytest.raises(PeerGone):
        connection.pump_recv()
    sender, connection = receiver()
    sender.sendall(frames(True, b"early", 9, 0, 4096) + codec().control_frame(ABORT, encode_abort(3, ABORT_EXITED,
                                                                                                    "rank 3 died")))
    sender.close()
    connection.pump_recv()
    assert connection.parked  # the early frame waits; its ABORT is behind it
    with pytest.raises(PeerGone) as gone:
        connection.on_hangup()
    assert gone.value.departure.kind == "abort" and gone.value.departure.culprit == 3
    assert gone.value.departure.text == "rank 3 died"


def test_a_close_in_the_middle_of_a_frame_is_a_cut():
    sender, connection = receiver()
    post(connection, 100, 0, 0)
    sender.sendall(frames(True, b"x" * 100, 0, 0, 4096)[:80])
    sender.close()
    with pytest.raises(PeerGone) as gone:
        connection.on_hangup()
    assert gone.value.departure.kind == "cut"


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=56, max_size=56), st.booleans())
def test_fuzz_headers_parse_or_are_refused(header, checked):
    c = codec(checked)
    try:
        frame = c.parse(header[:c.header_bytes])
    except FrameError:
        return
    assert frame.type in (DATA, GOODBYE, ABORT)
    problem = c.mismatch(frame, 1, 0, 0, 64) if frame.type == DATA else None
    if problem is None and frame.type == DATA:
        assert frame.length <= 64
