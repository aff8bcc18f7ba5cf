"""Clean programs exit 0 over MPICH's OFI netmod too, and a rank that exits early really ends.

Over OFI (``MPIR_CVAR_CH4_NETMOD=ofi``) an MPI object still allocated at MPI_Finalize made every
rank exit 15 after correct results ("fabricclose failed ... Device or resource busy"). This needs
no second host: OFI with the TCP provider on loopback shows it on one. The same programs run
across hosts in test_multihost.py.
"""

import pytest

from tests.support.mpirun import run_mpi

pytestmark = pytest.mark.mpi

# Loopback keeps the provider's listening sockets off the machine's real interfaces.
OFI_TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"}


@pytest.mark.parametrize("mode,nprocs", [("commlib", 2), ("subgroup", 3), ("early", 3)])
def test_clean_programs_exit_0_over_ofi(mode, nprocs):
    run_mpi("exit_ranks.py", nprocs, mode, env=OFI_TCP, timeout=90)


def test_torch_backend_program_exits_0_over_ofi():
    pytest.importorskip("torch")
    run_mpi("exit_ranks.py", 2, "torch", env=OFI_TCP, timeout=90)
