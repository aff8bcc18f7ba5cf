"""Finding rank 0's address without DNS (commlib.rendezvous.root_probe), on real sockets: the probe
answers only connections that prove the job secret, names what every failed attempt met, and logs
strangers once (under mpiexec, through the torch backend's store: tests/mpi/test_root_address.py)."""

import logging
import os
import socket
import time

from commlib.platform.addresses import interface_addresses, reaching_addresses, source_address_toward
from commlib.rendezvous.handshake import CHALLENGE_BYTES
from commlib.rendezvous.root_probe import ProbeListener, first_reachable
from commlib.rendezvous.secret import secret_from_text
from tests.support.launch import free_port

SECRET = secret_from_text("the probe tests' job secret", "tests")
OTHER = secret_from_text("another job's secret entirely", "tests")


def test_interface_addresses_are_usable_by_other_hosts():
    for address in interface_addresses():
        assert not address.startswith("127.") and address != "::1" and not address.startswith("fe80"), address


def test_the_address_that_reaches_a_peer_is_the_kernels_source_address():
    assert source_address_toward("127.0.0.1") == "127.0.0.1"
    assert reaching_addresses(["127.0.0.1", "127.0.0.1"]) == []  # loopback reaches no other host
    for address in interface_addresses()[:2]:
        if ":" not in address:
            assert source_address_toward(address) == address


def test_the_first_probe_proving_the_secret_wins_and_failures_are_named():
    probe = ProbeListener(SECRET, ["127.0.0.2", "127.0.0.1"], 2.0)
    other_job = ProbeListener(OTHER, ["127.0.0.1"], 2.0, token=probe.token)
    impostor = socket.create_server(("127.0.0.1", 0))  # listening, but never says a word
    refused_port = free_port()  # below the ephemeral range: no listener the kernel places takes it
    try:
        assert [address for address, _ in probe.endpoints] == ["127.0.0.2", "127.0.0.1"]  # each, not every interface
        chosen, attempts = first_reachable(probe.endpoints, probe.token, SECRET, 2.0)
        assert chosen == "127.0.0.2" and attempts == []
        chosen, attempts = first_reachable([("127.0.0.1", refused_port)], probe.token, SECRET, 2.0)
        assert chosen is None and attempts == [(f"127.0.0.1:{refused_port}", "Connection refused")]
        impostor_port = impostor.getsockname()[1]
        chosen, attempts = first_reachable([("127.0.0.1", impostor_port)], probe.token, SECRET, 0.5)
        assert chosen is None and "the handshake timed out" in attempts[0][1], attempts
        chosen, attempts = first_reachable(other_job.endpoints, probe.token, SECRET, 2.0)
        assert chosen is None and "another job's secret" in attempts[0][1], attempts
        chosen, attempts = first_reachable(probe.endpoints[1:], b"x" * 16, SECRET, 2.0)
        assert chosen is None and "another token" in attempts[0][1], attempts
    finally:
        for listener in (probe, other_job):
            listener.close()
        impostor.close()


def test_strangers_at_the_probe_are_refused_logged_once_and_bounded(caplog):
    probe = ProbeListener(SECRET, ["127.0.0.1"], 1.0, service="rank 0 address probe on test")
    address, port = probe.endpoints[0]
    idle = []
    try:
        with caplog.at_level(logging.WARNING, logger="commlib.auth"):
            for _ in range(3):
                with socket.create_connection((address, port)) as noisy:
                    noisy.sendall(os.urandom(4096))  # garbage: refused as not a handshake
                    noisy.settimeout(5)
                    assert len(noisy.recv(CHALLENGE_BYTES)) > 0  # the challenge, and nothing else
            idle = [socket.create_connection((address, port)) for _ in range(100)]
            time.sleep(0.3)
            chosen, _ = first_reachable(probe.endpoints, probe.token, SECRET, 5.0)  # served meanwhile
            assert chosen == address
            deadline = time.monotonic() + 20
            while probe.connections and time.monotonic() < deadline:  # closed at their handshake timeout
                time.sleep(0.1)
            assert probe.connections == []
        lines = [record.getMessage() for record in caplog.records]
        garbage = [line for line in lines if "not a commlib handshake" in line]
        assert len(garbage) == 1 and "refused a connection from 127.0.0.1" in garbage[0], lines
        bounded = [line for line in lines if "the oldest made room" in line]
        timed_out = [line for line in lines if "timed out" in line]
        assert len(bounded) <= 2 and 1 <= len(timed_out) <= 2, lines
    finally:
        for sock in idle:
            sock.close()
        probe.close()
