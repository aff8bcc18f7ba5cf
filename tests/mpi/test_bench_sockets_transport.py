"""``python -m commlib.bench --transport sockets`` under mpiexec: the measured group runs over
commlib's sockets (shared memory within the host) while the baseline is MPI's own collective, in
the same job; every algorithm's result is exact, at 2 and 3 ranks. Not a timing test."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.mpirun import ROOT, mpiexec_path


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_socket_group_is_measured_against_mpi_in_one_job(nprocs):
    command = [mpiexec_path(), "-n", str(nprocs), sys.executable, "-m", "commlib.bench", "--transport", "sockets",
               "-b", "8", "-e", "512K", "-f", "64", "-n", "2", "-w", "1", "-s", "64", "-a", "native,ring,tree,auto"]
    try:
        result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"commlib.bench --transport sockets at {nprocs} ranks hung (killed after 240 s): {hung.stdout}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "commlib over sockets" in result.stdout and "out of bounds values: 0 OK" in result.stdout, result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line and not line.startswith(("#", "  size"))]
    rows = [row for row in rows if row[0] != "size"]
    names = ["MPI_Allreduce", "native", "ring", "tree", "auto"]
    assert [(int(row[0]), row[3]) for row in rows] == [(size, name) for size in (8, 512, 32768) for name in names]
    assert all(row[7] == "0" for row in rows), result.stdout
