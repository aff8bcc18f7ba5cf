"""Finding rank 0's address without DNS (commlib.root_address), on real sockets."""

import socket

import pytest

from mpirun import run_mpi

from commlib.root_address import _first_reachable, _ProbeListener, interface_addresses


def test_interface_addresses_are_usable_by_other_hosts():
    for address in interface_addresses():
        assert not address.startswith("127.") and address != "::1" and not address.startswith("fe80"), address


def test_the_first_address_answering_with_the_token_wins_and_failures_are_named():
    probe = _ProbeListener(b"t" * 16)
    impostor = socket.create_server(("127.0.0.1", 0))  # listening, but never sends the token
    refused = socket.create_server(("127.0.0.1", 0))
    refused_port = refused.getsockname()[1]
    refused.close()
    try:
        chosen, attempts = _first_reachable(["127.0.0.2", "127.0.0.1"], probe.port, probe.token, 2.0)
        assert chosen == "127.0.0.2" and attempts == []
        chosen, attempts = _first_reachable(["127.0.0.1"], refused_port, probe.token, 2.0)
        assert chosen is None and attempts == [(f"127.0.0.1:{refused_port}", "Connection refused")]
        impostor_port = impostor.getsockname()[1]
        chosen, attempts = _first_reachable(["127.0.0.1"], impostor_port, probe.token, 0.5)
        assert chosen is None and attempts[0] == (f"127.0.0.1:{impostor_port}", "no answer within 0.5 s"), attempts
    finally:
        probe.close()
        impostor.close()


@pytest.mark.mpi
def test_rendezvous_store_on_one_host_and_with_master_addr_and_port():
    pytest.importorskip("torch")
    run_mpi("rendezvous_check.py", 2, timeout=90)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run_mpi("rendezvous_check.py", 2, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, timeout=90)
