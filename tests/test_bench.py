"""``python -m commlib.bench`` at P=2 on tiny sizes: the table parses and nothing is wrong.

Not a timing test: it checks the benchmark runs every algorithm of each collective plus the MPI
baseline, reports #wrong == 0 per row with nccl-tests' bus factor, and writes the same rows as JSON;
and that the barrier's #wrong (no data to compare) does catch a barrier that lets ranks out early.
"""

import json
import subprocess
import sys

import pytest

from mpirun import ROOT, mpiexec_path, run_mpi

ALGORITHMS = ["hierarchical", "native", "rabenseifner", "recursive_doubling", "ring", "shm_oneshot", "shm_twoshot",
              "tree", "auto"]  # the registry's order


def parse_table(output: str):
    rows = []
    for line in output.splitlines():
        fields = line.split()
        if line.startswith("#") or not fields or fields[0] == "size":
            continue
        size, count, dtype, algorithm, time_us, algbw, busbw, wrong, ratio = fields
        rows.append(dict(size=int(size), count=int(count), dtype=dtype, algorithm=algorithm,
                         time_us=float(time_us), algbw=float(algbw), busbw=float(busbw),
                         wrong=None if wrong == "-" else int(wrong), ratio=float(ratio)))
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
    assert "# ranks per host: 1 host: " in result.stdout and " [0,1]" in result.stdout
    assert [(r["size"], r["algorithm"], r["wrong"]) for r in json.loads(json_path.read_text())] == \
        [(r["size"], r["algorithm"], r["wrong"]) for r in rows]


@pytest.mark.mpi
def test_bench_times_the_shared_memory_algorithms_on_symmetric_buffers_too():
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "commlib.bench", "-b", "8", "-e", "64K",
               "-f", "64", "-n", "3", "-w", "1", "-a", "shm_oneshot,shm_twoshot,auto", "--symmetric", "--floor"]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = parse_table(result.stdout)
    names = ["MPI_Allreduce", "shm_oneshot", "shm_twoshot", "auto", "shm_oneshot@sym", "shm_twoshot@sym", "auto@sym",
             "floor:twoshot"]
    assert [(row["size"], row["algorithm"]) for row in rows] == [(size, name) for size in (8, 512, 32768)
                                                                  for name in names], result.stdout
    # The floor is not an allreduce: unchecked, and left out of the verdict.
    assert all(row["wrong"] == (None if row["algorithm"] == "floor:twoshot" else 0) for row in rows), result.stdout
    assert "out of bounds values: 0 OK" in result.stdout


@pytest.mark.parametrize("size,rank", [(2, 0), (2, 1), (3, 2), (5, 1)])
def test_the_two_shot_floor_does_the_two_shot_work_on_every_element(size, rank):
    """Its reduce reads the stand-in P - 1 times into this rank's slice and every other slice is
    copied from that slice, so from zeros and a stand-in of ones every element ends at P - 1 (odd
    lengths, several rounds)."""
    import numpy as np

    from commlib.bench_floor import twoshot_floor
    from commlib.ops import ReduceOp

    for count in (size, 1001, 40_003):
        buf = np.zeros(count, np.float32)
        twoshot_floor(buf, np.ones(count, np.float32), rank, size, ReduceOp.SUM, round_bytes=16 << 10)()
        assert np.array_equal(buf, np.full(count, size - 1, np.float32)), (count, np.unique(buf))


@pytest.mark.mpi
@pytest.mark.parametrize("collective,suffix", [("broadcast", "@sym"), ("gather", "@sym"), ("allgather", "@symio"),
                                               ("scatter", "@symio"), ("alltoall", "@symio")])
def test_bench_times_the_data_movers_on_symmetric_buffers_and_checks_them(collective, suffix):
    """``--symmetric``: the source in pg.alloc (rows ``@sym``); ``--symmetric-output`` too: the
    output as well (``@symio``, where every rank has one). Every row is checked."""
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "commlib.bench", "--collective", collective,
               "-b", "8", "-e", "64K", "-f", "64", "-n", "3", "-w", "1", "-s", "64", "-a", "shm_direct",
               "--symmetric"] + (["--symmetric-output"] if suffix == "@symio" else [])
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = parse_table(result.stdout)
    assert [row["algorithm"] for row in rows][1:3] == ["shm_direct", f"shm_direct{suffix}"], result.stdout
    assert len(rows) == 9 and all(row["wrong"] == 0 for row in rows), result.stdout


def test_bench_refuses_a_symmetric_output_where_there_is_none():
    result = subprocess.run([sys.executable, "-m", "commlib.bench", "--collective", "gather", "--symmetric",
                             "--symmetric-output"], cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--symmetric-output: only with --symmetric and --collective" in result.stderr


@pytest.mark.parametrize("size", [2, 3, 5])
def test_the_push_floor_reduces_and_writes_every_element_on_exactly_one_rank(size):
    """The symmetric buffers' schedule: each rank reduces its chunks (P - 1 reads of the stand-in)
    and copies them into the P - 1 destinations where the collective writes its peers; over the
    ranks, every element of every round is done exactly once (odd lengths, several rounds)."""
    import numpy as np

    from commlib.bench_floor import twoshot_floor
    from commlib.ops import ReduceOp

    for count in (size, 1001, 40_003):
        done = np.zeros(count, np.int64)
        for rank in range(size):
            buf = np.zeros(count, np.float32)
            destinations = [np.zeros(count, np.float32) for _ in range(size - 1)]
            twoshot_floor(buf, np.ones(count, np.float32), rank, size, ReduceOp.SUM, round_bytes=16 << 10,
                          push=True, destinations=destinations)()
            mine = buf != 0
            assert np.array_equal(buf[mine], np.full(int(mine.sum()), size - 1, np.float32)), (count, rank)
            for destination in destinations:
                assert np.array_equal(destination, buf), (count, rank)
            done += mine
        assert np.array_equal(done, np.ones(count, np.int64)), (count, np.unique(done))


@pytest.mark.mpi
@pytest.mark.parametrize("collective,factor", [("broadcast", 1.0), ("reduce", 1.0), ("allgather", 0.5),
                                               ("reduce_scatter", 0.5), ("alltoall", 0.5)])
def test_bench_of_every_collective_checks_its_results(tmp_path, collective, factor):
    """Every algorithm of the collective plus auto, after the MPI library's own; busbw by nccl-tests' factor (P=2)."""
    import commlib

    json_path = tmp_path / "rows.json"
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "commlib.bench", "--collective", collective,
               "-b", "8", "-e", "64K", "-f", "32", "-n", "3", "-w", "1", "-s", "64", "-d", "int32",
               "--json", str(json_path)]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = parse_table(result.stdout)
    baseline = {"broadcast": "MPI_Bcast", "reduce": "MPI_Reduce", "allgather": "MPI_Allgather",
                "reduce_scatter": "MPI_Reduce_scatter_block", "alltoall": "MPI_Alltoall"}[collective]
    names = [baseline] + commlib.algorithms(collective) + ["auto"]
    assert [(row["size"], row["algorithm"]) for row in rows] == [(size, name) for size in (8, 256, 8192)
                                                                  for name in names], result.stdout
    for row in rows:
        assert row["wrong"] == 0 and row["time_us"] > 0, row
        assert row["busbw"] == pytest.approx(row["algbw"] * factor, abs=2e-3), row
    assert all(row["collective"] == collective for row in json.loads(json_path.read_text()))


@pytest.mark.mpi
def test_bench_barrier_row_times_every_algorithm_after_mpi_barrier(tmp_path):
    """No payload: one row per contender, size/count/algbw/busbw 0, dtype '-', and the arrival check."""
    import commlib

    json_path = tmp_path / "rows.json"
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "commlib.bench", "--collective", "barrier",
               "-n", "5", "-w", "1", "--json", str(json_path)]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = parse_table(result.stdout)
    assert [row["algorithm"] for row in rows] == ["MPI_Barrier"] + commlib.algorithms("barrier") + ["auto"], \
        result.stdout
    for row in rows:
        assert (row["size"], row["count"], row["dtype"], row["algbw"], row["busbw"], row["wrong"]) == \
            (0, 0, "-", 0.0, 0.0, 0), row
        assert row["time_us"] > 0, row
    assert "barrier exits before a peer arrived: 0 OK" in result.stdout
    assert [(r["algorithm"], r["dtype"], r["wrong"]) for r in json.loads(json_path.read_text())] == \
        [(r["algorithm"], None, 0) for r in rows]


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs,broken", [(2, "no_wait"), (3, "first_round_only")])
def test_bench_barrier_check_catches_a_barrier_that_lets_ranks_out_early(tmp_path, nprocs, broken):
    """A barrier that returns at once (P=2), or dissemination's first round alone (enough at P=2, not
    at P=3): #wrong > 0 and exit status 1; the library's and native on the same run: 0."""
    json_path = tmp_path / "rows.json"
    result = run_mpi("bench_broken_barrier.py", nprocs, broken, str(json_path), timeout=120, check=False)
    assert result.returncode == 1, result.stdout
    wrong = {row["algorithm"]: row["wrong"] for row in json.loads(json_path.read_text())}
    assert wrong["MPI_Barrier"] == 0 and wrong["native"] == 0 and wrong[broken] > 0, result.stdout
    assert "barrier exits before a peer arrived" in result.stdout and "FAILED" in result.stdout


def test_bench_rejects_bad_arguments():
    result = subprocess.run([sys.executable, "-m", "commlib.bench", "-b", "1M", "-e", "8"],
                            cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "min (1048576) <= max (8)" in result.stderr


@pytest.mark.mpi
def test_ddp_bench_runs_every_configuration_and_writes_its_rows(tmp_path):
    """``python -m ddp.bench`` at P=2, one tiny turn: every column is filled (not a timing test)."""
    json_path = tmp_path / "ddp.json"
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "ddp.bench", "--model", "transformer",
               "--batch", "1", "--caps", "25", "--steps", "2", "--warmup", "1", "--rounds", "1",
               "--json", str(json_path)]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(json_path.read_text())
    assert [(row["cap_mb"], row["view"]) for row in rows] == [(25, False), (25, True)], rows
    for row in rows:
        for key in ("ours_ms", "mpi_only_ms", "gloo_ms", "torch_commlib_ms", "nosync_ms", "local_ms"):
            assert row[key] > 0, (key, row)
        assert row["buckets"] >= 1 and row["bufs_per_grad"] == pytest.approx(1.0, abs=0.01)
        assert 0 <= row["hidden"] <= 1
    assert rows[0]["extra_per_grad"] == pytest.approx(1.0, abs=0.01)  # buckets beside the grads
    assert rows[1]["extra_per_grad"] == pytest.approx(0.0, abs=0.01)  # grads are bucket views
    assert "ours/gloo" in result.stdout


@pytest.mark.mpi
def test_ddp_bench_sync_rows_count_the_bytes_of_each_method(tmp_path):
    """``python -m ddp.bench --sync`` at P=2, one tiny block each: a row per method, and the bytes
    per step say what each sends (not a timing test): ``local`` never averages (the floor row)."""
    json_path = tmp_path / "sync.json"
    methods = ["ddp", "powersgd", "localsgd", "partial", "local"]
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "ddp.bench", "--sync", *methods,
               "--model", "transformer", "--batch", "1", "--period", "2", "--steps", "2", "--warmup", "1",
               "--rounds", "1", "--json", str(json_path)]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["sync"]: row for row in json.loads(json_path.read_text())}
    assert list(rows) == methods, rows
    assert all(row["ms_per_step"] > 0 for row in rows.values()), rows
    assert rows["local"]["mb_per_step"] == 0, rows["local"]
    assert 0 < rows["powersgd"]["mb_per_step"] < rows["ddp"]["mb_per_step"] / 10, rows
    # H=2: one average of the parameters (the gradients' size) every 2 steps
    assert rows["localsgd"]["mb_per_step"] == pytest.approx(rows["ddp"]["mb_per_step"] / 2, rel=0.01), rows


@pytest.mark.mpi
def test_torch_backend_bench_compares_commlib_and_gloo(tmp_path):
    json_path = tmp_path / "bridge.json"
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "autograd_bridge.bench", "--samples", "3",
               "--steps", "1", "--json", str(json_path)]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gloo/commlib" in result.stdout, result.stdout
    rows = json.loads(json_path.read_text())["allreduce"]
    assert rows and all(row["commlib_wrong"] == 0 and row["gloo_wrong"] == 0 for row in rows), rows
    assert all(row["commlib_us"] > 0 and row["gloo_us"] > 0 for row in rows), rows
