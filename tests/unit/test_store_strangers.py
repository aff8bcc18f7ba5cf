"""Strangers at the TCP store's port: refused, logged, and the store goes on serving its job exactly."""

import logging
import os
import socket
import struct
import time

import pytest

from commlib import CommError
from commlib.rendezvous import TCPStore, TCPStoreServer
from commlib.rendezvous.handshake import CHALLENGE_BYTES, REPLY_BYTES, AuthenticationError, ClientHandshake
from commlib.rendezvous.secret import secret_from_text

SECRET = secret_from_text("the secret of the stranger tests", "test")
OTHER = secret_from_text("a stale job's different secret", "test")


@pytest.fixture
def server():
    server = TCPStoreServer("127.0.0.1", 0, SECRET, handshake_timeout=0.5).start()
    yield server
    server.close()


def recv_exactly(sock, count):
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            break
        data += chunk
    return data


def raw(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def refusals(caplog):
    return [record.getMessage() for record in caplog.records if record.name == "commlib.auth"]


def still_serves(server, key="alive"):
    store = TCPStore("127.0.0.1", server.port, SECRET, timeout=10)
    assert store.add(key, 1) >= 1
    store.close()


def wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_another_jobs_secret_is_refused_with_a_clear_error_on_both_sides(server, caplog):
    with caplog.at_level(logging.WARNING, logger="commlib.auth"):
        with pytest.raises(AuthenticationError, match="another job's secret"):
            TCPStore("127.0.0.1", server.port, OTHER, timeout=5)
        assert wait_until(lambda: refusals(caplog))
    assert "another job's secret" in refusals(caplog)[0] and "127.0.0.1:" in refusals(caplog)[0]
    still_serves(server)


def test_random_bytes_truncated_handshakes_and_silence_are_refused_and_logged(server, caplog):
    with caplog.at_level(logging.WARNING, logger="commlib.auth"):
        noisy = raw(server)
        noisy.sendall(os.urandom(100 << 10))
        truncated = raw(server)
        truncated.sendall(os.urandom(50))
        truncated.close()
        silent = raw(server)
        assert wait_until(lambda: len(refusals(caplog)) >= 3)
        assert recv_exactly(silent, CHALLENGE_BYTES + 1)[:4] == b"CLHS"  # challenge, then closed at the timeout
    text = " | ".join(refusals(caplog))
    assert "not a commlib handshake" in text
    assert "closed the connection during the handshake" in text
    assert "no handshake within 0.5 s" in text
    still_serves(server)
    noisy.close()
    silent.close()


def test_a_replayed_handshake_is_refused(server, caplog):
    real = raw(server)
    client = ClientHandshake(SECRET, "store")
    captured = client.answer(recv_exactly(real, CHALLENGE_BYTES))
    real.sendall(captured)
    client.finish(recv_exactly(real, REPLY_BYTES))  # the real rank's connection: accepted
    with caplog.at_level(logging.WARNING, logger="commlib.auth"):
        replay = raw(server)
        recv_exactly(replay, CHALLENGE_BYTES)
        replay.sendall(captured)
        reply = recv_exactly(replay, REPLY_BYTES)
        assert reply[5] == 4 and reply[7] == 4  # a REFUSE, reason: wrong MAC
        assert recv_exactly(replay, 1) == b""  # and closed
    assert "forged or replayed" in refusals(caplog)[0]
    real.close()
    still_serves(server)


def authenticated(server):
    sock = raw(server)
    client = ClientHandshake(SECRET, "store")
    sock.sendall(client.answer(recv_exactly(sock, CHALLENGE_BYTES)))
    client.finish(recv_exactly(sock, REPLY_BYTES))
    return sock


def test_an_authenticated_peer_announcing_a_huge_frame_is_dropped_not_served(server, caplog):
    with caplog.at_level(logging.WARNING, logger="commlib.auth"):
        sock = authenticated(server)
        sock.sendall(struct.pack("<I", 0xFFFFFFF0) + b"\x01" * 1000)
        assert recv_exactly(sock, 1) == b""
    assert "announces 4294967280 bytes" in refusals(caplog)[0]
    garbled = authenticated(server)
    garbled.sendall(struct.pack("<I", 9) + b"\x01" + struct.pack("<I", 1000) + b"abcd")  # a field overruns
    assert recv_exactly(garbled, 1) == b""
    still_serves(server)


def test_idle_connections_cost_nothing_and_expire(server):
    idle = [raw(server) for _ in range(300)]
    still_serves(server)
    assert wait_until(lambda: server.connections == 0, 20)
    for sock in idle:
        sock.close()


def test_connections_beyond_the_bound_are_refused():
    server = TCPStoreServer("127.0.0.1", 0, SECRET, max_connections=4, handshake_timeout=30).start()
    try:
        held = [raw(server) for _ in range(4)]
        assert wait_until(lambda: server.connections == 4)
        extra = raw(server)
        assert recv_exactly(extra, 1) == b""
        for sock in held:
            sock.close()
        assert wait_until(lambda: server.connections == 0)
        still_serves(server)
    finally:
        server.close()


def test_an_open_store_and_a_rank_with_a_secret_say_so():
    server = TCPStoreServer("127.0.0.1", 0, None).start()
    try:
        with pytest.raises(AuthenticationError, match="open job"):
            TCPStore("127.0.0.1", server.port, SECRET, timeout=5)
        TCPStore("127.0.0.1", server.port, None, timeout=5).set("k", b"v")
    finally:
        server.close()


def test_a_client_whose_server_went_away_says_so():
    server = TCPStoreServer("127.0.0.1", 0, SECRET).start()
    store = TCPStore("127.0.0.1", server.port, SECRET)
    server.close()
    with pytest.raises(CommError, match=r"connection is lost|closed"):
        store.set("k", b"v")
