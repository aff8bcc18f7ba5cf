"""The socket transport under mpiexec (its rendezvous and secret over MPI), and its benchmark."""

import json
import subprocess
import sys

import pytest

from tests.support.mpirun import ROOT, mpiexec_path, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_socket_transport_met_through_mpi(nprocs):
    result = run_mpi("sockets_over_mpi_ranks.py", nprocs, timeout=300)
    assert "OK:" in result.stdout


@pytest.mark.mpi
def test_socket_bench_table_parses_and_nothing_is_wrong(tmp_path):
    json_path = tmp_path / "rows.json"
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "commlib.bench.sockets", "--sizes", "8,1M",
               "-n", "3", "-w", "1", "--json", str(json_path)]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [row for row in json.loads(json_path.read_text()) if "wrong" in row]
    assert [(row["size"], row["contender"]) for row in rows] == [
        (size, name) for size in (8, 1 << 20) for name in ("MPI_Allreduce", "sockets", "sockets:nochecks")]
    assert all(row["wrong"] == 0 and row["time_us"] > 0 for row in rows), rows
    assert "the per-frame checks cost" in result.stdout and "CPU time of one message" in result.stdout
