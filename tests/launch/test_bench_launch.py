"""The benchmarks launched without MPI: ``python -m commlib.bench`` under torchrun prints the
table it prints under mpiexec (same header, a row per size and algorithm, nothing wrong; no MPI
baseline: no MPI library spans the job), the barrier's check works over the group's own
rendezvous, its record names the torchrun launch; ``autograd_bridge.bench.versus_gloo`` times
commlib against gloo in one torchrun job. Not timing tests: every figure is only checked to be a
time."""

from __future__ import annotations

import pytest

from autograd_bridge.bench.versus_gloo import COLUMNS as VERSUS_COLUMNS
from commlib.bench.record import read_record
from commlib.bench.rows import COLUMNS
from commlib.bench.table import header_line, names
from tests.support.launch import ROOT, run_torchrun

pytestmark = pytest.mark.launch

BENCH = ROOT / "commlib" / "bench" / "__main__.py"
VERSUS_GLOO = ROOT / "autograd_bridge" / "bench" / "versus_gloo.py"
ALGORITHMS = ["hierarchical", "native", "rabenseifner", "recursive_doubling", "ring", "shm_oneshot", "shm_twoshot",
              "tree", "auto"]  # the registry's order


def table(output: str, columns):
    """The printed rows (split into fields), after checking the header is the benchmark's own
    (torchrun's and torch's warnings are in the output too: only the table's lines count)."""
    header = header_line(columns)
    assert header in output.splitlines(), output[-3000:]
    return [line.split() for line in output.splitlines()
            if len(line.split()) == len(columns) and line.split()[0].isdigit()]


@pytest.mark.parametrize("nproc", [2, 3])
def test_commlib_bench_under_torchrun_prints_the_same_table(tmp_path, nproc):
    record_path = tmp_path / "rows.json"
    flags = ["-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1", "-s", "64", "--json", str(record_path)]
    output = run_torchrun(BENCH, nproc, *flags, timeout=300).stdout
    rows = table(output, COLUMNS)
    sizes = [8, 64, 512, 4096]
    assert [(int(row[0]), row[3]) for row in rows] == [(size, name) for size in sizes for name in ALGORITHMS], output
    assert all(row[7] == "0" and float(row[4]) > 0 and row[8] == "nan" for row in rows), output
    assert "no MPI baseline" in output and "out of bounds values: 0 OK" in output
    record = read_record(record_path)
    assert record["command"] == " ".join(["torchrun", "--nproc-per-node", str(nproc), "-m", "commlib.bench", *flags])
    assert record["world_size"] == nproc and record["columns"] == names(COLUMNS)
    assert [(row["size"], row["algorithm"], row["#wrong"]) for row in record["rows"]] == \
        [(int(row[0]), row[3], 0) for row in rows]


def test_the_barrier_check_runs_over_the_group_without_mpi():
    output = run_torchrun(BENCH, 3, "-c", "barrier", "-n", "3", "-w", "1", timeout=300).stdout
    rows = table(output, COLUMNS)
    assert [row[3] for row in rows] == ["dissemination", "native", "auto"], output
    # A count (0), not '-': the arrival board was mapped through the store's host rendezvous.
    assert all(row[7] == "0" for row in rows) and "barrier exits before a peer arrived: 0 OK" in output, output


def test_versus_gloo_times_both_backends_in_one_torchrun_job(tmp_path):
    record_path = tmp_path / "versus.json"
    output = run_torchrun(VERSUS_GLOO, 2, "--sizes", "8,64K", "-a", "ring,shm_twoshot", "-n", "3", "-w", "1",
                          "--json", str(record_path), timeout=300).stdout
    rows = table(output, VERSUS_COLUMNS)
    contenders = ["gloo", "commlib", "commlib:ring", "commlib:shm_twoshot"]
    assert [(int(row[0]), row[1]) for row in rows] == [(size, name) for size in (8, 65536) for name in contenders]
    assert all(row[5] == "0" and float(row[3]) > 0 for row in rows), output
    assert all(float(row[6]) == 1.0 for row in rows if row[1] == "gloo"), output
    record = read_record(record_path)
    assert record["command"].startswith("torchrun --nproc-per-node 2 -m autograd_bridge.bench.versus_gloo --sizes")
    assert [row["#wrong"] for row in record["rows"]] == [0] * len(rows)
