"""Every rank finds the torch backend's store at rank 0's address without DNS, or at
MASTER_ADDR/MASTER_PORT (commlib.rendezvous.root_probe; its parts: tests/unit/test_root_address.py)."""

import socket

import pytest

from tests.support.mpirun import run_mpi


@pytest.mark.mpi
def test_rendezvous_store_on_one_host_and_with_master_addr_and_port():
    pytest.importorskip("torch")
    run_mpi("root_address_ranks.py", 2, timeout=90)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run_mpi("root_address_ranks.py", 2, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, timeout=90)
