"""Every rank finds the torch backend's store at rank 0's address without DNS, or at
MASTER_ADDR/MASTER_PORT (commlib.rendezvous.root_probe; its parts: tests/unit/test_root_address.py)."""

import socket

import pytest

from tests.support.mpirun import Job, Part


@pytest.mark.mpi
def test_rendezvous_store_on_one_host_and_with_master_addr_and_port():
    pytest.importorskip("torch")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    master = ("127.0.0.1", str(port))
    job = Job(Part("root_address_ranks.py"), Part("root_address_ranks.py", *master), timeout=120)  # one torch start
    job.check(2, "root_address_ranks.py")
    job.check(2, "root_address_ranks.py", *master)
