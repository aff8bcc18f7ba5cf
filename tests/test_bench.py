"""``python -m commlib.bench`` at P=2 on tiny sizes: the table parses and nothing is wrong.

Not a timing test: it checks the benchmark runs every algorithm plus the MPI baseline, reports
#wrong == 0 per row, and writes the same rows as JSON.
"""

import json
import subprocess
import sys

import pytest

from mpirun import ROOT, mpiexec_path

ALGORITHMS = ["native", "ring", "tree", "recursive_doubling", "rabenseifner", "auto"]


def parse_table(output: str):
    rows = []
    for line in output.splitlines():
        fields = line.split()
        if line.startswith("#") or not fields or fields[0] == "size":
            continue
        size, count, dtype, algorithm, time_us, algbw, busbw, wrong, ratio = fields
        rows.append(dict(size=int(size), count=int(count), dtype=dtype, algorithm=algorithm,
                         time_us=float(time_us), algbw=float(algbw), busbw=float(busbw),
                         wrong=int(wrong), ratio=float(ratio)))
    return rows


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "int8", "bfloat16"])
def test_bench_table_parses_and_nothing_is_wrong(tmp_path, dtype):
    json_path = tmp_path / "rows.json"
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "commlib.bench", "-b", "8", "-e", "4K",
               "-f", "8", "-n", "3", "-w", "1", "-s", "64", "-d", dtype, "--json", str(json_path)]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = parse_table(result.stdout)
    sizes = [8, 64, 512, 4096]
    expected = [(size, name) for size in sizes for name in ["MPI_Allreduce"] + ALGORITHMS]
    assert [(row["size"], row["algorithm"]) for row in rows] == expected, result.stdout
    itemsize = {"float32": 4, "int8": 1, "bfloat16": 2}[dtype]
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["count"] == row["size"] // itemsize and row["dtype"] == dtype
        assert row["time_us"] > 0 and row["busbw"] == pytest.approx(row["algbw"], abs=2e-3)  # P=2
    assert "out of bounds values: 0 OK" in result.stdout
    assert [(r["size"], r["algorithm"], r["wrong"]) for r in json.loads(json_path.read_text())] == \
        [(r["size"], r["algorithm"], r["wrong"]) for r in rows]


def test_bench_rejects_bad_arguments():
    result = subprocess.run([sys.executable, "-m", "commlib.bench", "-b", "1M", "-e", "8"],
                            cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "min (1048576) <= max (8)" in result.stderr
