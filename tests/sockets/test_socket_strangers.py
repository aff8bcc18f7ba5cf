"""Strangers at a rank's listening port while the mesh forms, ranks of another job, ranks that
disagree on settings, and TLS: refused, logged, and the job's collectives stay exact."""

import os
import shutil
import time
import socket
import subprocess

import pytest

from commlib.rendezvous import TCPStore
from commlib.rendezvous.handshake import CHALLENGE_BYTES, REPLY_BYTES, ClientHandshake
from commlib.rendezvous.secret import secret_from_text
from commlib.transports.socket import SocketOptions, TLSFiles
from tests.support.socket_world import SECRET, RankSetup, SocketWorld

RANKS = "tests.sockets.socket_ranks"
OTHER = secret_from_text("another job's secret entirely", "tests")


def listening(pid):
    """(address, port) of the TCP sockets process ``pid`` listens on (what ``ss -ltnp`` shows)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    with open(f"/proc/{pid}/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.append((socket.inet_ntoa(bytes.fromhex(address)[::-1]), int(port, 16)))
    return found


def recv_exactly(sock, count):
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            break
        data += chunk
    return data


def wait_for(condition, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    return condition()


@pytest.mark.timeout(300)
def test_strangers_at_the_listener_are_refused_logged_and_the_job_goes_on():
    options = SocketOptions(handshake_timeout=1.0)
    with SocketWorld(2, setup=RankSetup(options=options), per_rank={1: RankSetup(options=options, connect_after="go")},
                     wait=False) as world:
        pid = world.processes[0].pid
        ports = wait_for(lambda: listening(pid))
        assert ports and all(address == "127.0.0.1" for address, _ in ports), ports  # bound narrowly
        address, port = ports[0]
        other = socket.create_connection((address, port))
        client = ClientHandshake(OTHER, "transport", b"x" * 24)
        other.sendall(client.answer(recv_exactly(other, CHALLENGE_BYTES)))
        reply = recv_exactly(other, REPLY_BYTES)
        assert reply[5] == 4 and reply[7] == 3, reply[:8]  # REFUSE: another job's secret
        noisy = socket.create_connection((address, port))
        noisy.sendall(os.urandom(100 << 10))
        truncated = socket.create_connection((address, port))
        truncated.sendall(os.urandom(50))
        truncated.close()
        idle = [socket.create_connection((address, port)) for _ in range(50)]
        time.sleep(2.5)  # past their handshake timeout: dropped, and logged once
        TCPStore("127.0.0.1", world.port, SECRET).set("go", b"1")  # rank 1 may join now
        assert all(outcome[0] == "ok" for outcome in world.wait_started()), world.wait_started()
        assert world.run(f"{RANKS}:sum_of_ranks") == [[3] * 5] * 2
        assert listening(pid) == []  # the listener closed with the mesh up
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, port), timeout=5)
        lines = " | ".join(world.run(f"{RANKS}:refusals")[0])
        for sock in idle + [other, noisy]:
            sock.close()
    for why in ("another job's secret", "not a commlib handshake", "closed the connection during the handshake",
                "no handshake within 1 s"):
        assert why in lines, (why, lines)
    assert "127.0.0.1:" in lines


@pytest.mark.timeout(300)
def test_idle_strangers_past_the_half_open_bound_cannot_lock_a_late_rank_out():
    # Their handshake timeout (120 s) outlasts the mesh's (40 s): were the newest connection refused
    # at the bound, rank 1 could not join until the strangers expired and the mesh would time out.
    options = SocketOptions(handshake_timeout=120.0)
    with SocketWorld(2, setup=RankSetup(options=options, timeout=40),
                     per_rank={1: RankSetup(options=options, timeout=40, connect_after="go")}, wait=False) as world:
        pid = world.processes[0].pid
        address, port = wait_for(lambda: listening(pid))[0]
        idle = [socket.create_connection((address, port)) for _ in range(150)]  # > the 64 authenticating at once
        try:
            time.sleep(1.0)  # accepted, each waiting for its response
            started = time.monotonic()
            TCPStore("127.0.0.1", world.port, SECRET).set("go", b"1")
            assert all(outcome[0] == "ok" for outcome in world.wait_started()), world.wait_started()
            assert time.monotonic() - started < 30  # not at the strangers' timeout
            assert world.run(f"{RANKS}:sum_of_ranks") == [[3] * 5] * 2
            lines = " | ".join(world.run(f"{RANKS}:refusals")[0])
        finally:
            for sock in idle:
                sock.close()
    assert "the oldest made room" in lines and "127.0.0.1:" in lines, lines


@pytest.mark.timeout(300)
def test_a_rank_with_another_jobs_secret_cannot_join_and_both_sides_say_why():
    with SocketWorld(2, setup=RankSetup(timeout=8), per_rank={1: RankSetup(secret=OTHER, timeout=8)}) as world:
        outcomes = world.started
    assert outcomes[1][0] == "error" and "AuthenticationError" in outcomes[1][1], outcomes[1]
    assert "another job's secret" in outcomes[1][1], outcomes[1][1]
    assert outcomes[0][0] == "error" and "CommTimeoutError" in outcomes[0][1], outcomes[0]
    assert "rank 1 never connected" in outcomes[0][1] and "another job's secret" in outcomes[0][1], outcomes[0][1]


@pytest.mark.timeout(300)
def test_ranks_that_disagree_on_frame_checks_are_told_which_setting():
    with SocketWorld(2, setup=RankSetup(timeout=8),
                     per_rank={1: RankSetup(options=SocketOptions(frame_checks=False), timeout=8)}) as world:
        outcomes = world.started
    assert outcomes[1][0] == "error" and "COMMLIB_SOCKET_FRAME_CHECKS" in outcomes[1][1], outcomes[1]
    assert outcomes[0][0] == "error" and "frame checks off" in outcomes[0][1], outcomes[0]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=commlib",
                    "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")],
                   check=True, capture_output=True, timeout=120)
    return TLSFiles(str(folder / "cert.pem"), str(folder / "key.pem"))


@pytest.mark.timeout(300)
def test_tls_links_carry_the_algorithms_exactly(certificate):
    options = SocketOptions(tls=certificate)
    with SocketWorld(3, setup=RankSetup(options=options)) as world:
        assert all(outcome[0] == "ok" for outcome in world.started), world.started
        assert world.run(f"{RANKS}:algorithms_over", ["native", "ring", "recursive_doubling"]) == [None] * 3
        assert world.run(f"{RANKS}:run_barrier", "native") == [None] * 3


@pytest.mark.timeout(300)
def test_a_rank_without_tls_cannot_join_a_tls_job(certificate):
    with SocketWorld(2, setup=RankSetup(options=SocketOptions(tls=certificate), timeout=8),
                     per_rank={1: RankSetup(timeout=8)}) as world:
        outcomes = world.started
    assert all(outcome[0] == "error" for outcome in outcomes), outcomes
