"""``python -m commlib.bench`` and ``python -m ddp.bench`` at P=2-3 on tiny sizes: the tables
parse, nothing is wrong, every row reaches ``--json`` in the one record format, and the check
catches what is broken.

Not timing tests: they check the benchmarks run every algorithm of each collective plus the MPI
baseline, report #wrong == 0 per row with nccl-tests' bus factor, and write the same rows as
JSON; that #wrong counts a wrong result of every collective (an algorithm that gets one element
wrong, a barrier that lets ranks out early); and that the DDP benchmarks fill every column.
The spec table and the record format alone: ``tests/unit/test_bench_units.py``.
"""

import importlib.metadata
import json
import math
import re
import subprocess
import sys

import pytest

from commlib.bench.record import read_record
from tests.support.mpirun import ROOT, mpiexec_path, run_mpi

ALGORITHMS = ["hierarchical", "native", "rabenseifner", "recursive_doubling", "ring", "shm_oneshot", "shm_twoshot",
              "tree", "auto"]  # the registry's order
HEADER = ["size", "count", "dtype", "algorithm", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "ratio"]


def parse_table(output: str):
    rows = []
    for line in output.splitlines():
        fields = line.split()
        if line.startswith("#") or not fields:
            continue
        if fields[0] == "size":
            assert fields == HEADER, line
            continue
        size, count, dtype, algorithm, time_us, algbw, busbw, wrong, ratio = fields
        rows.append(dict(size=int(size), count=int(count), dtype=dtype, algorithm=algorithm,
                         time_us=float(time_us), algbw=float(algbw), busbw=float(busbw),
                         wrong=None if wrong == "-" else int(wrong), ratio=float(ratio)))
    return rows


def bench(*flags, nprocs=2, timeout=120):
    command = [mpiexec_path(), "-n", str(nprocs), sys.executable, "-m", "commlib.bench", *map(str, flags)]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def assert_record_is_the_table(record, table, flags, nprocs=2):
    """The JSON says what the table printed, row for row, and how it was made."""
    assert record["benchmark"] == "commlib.bench" and record["world_size"] == nprocs
    assert record["command"] == " ".join(["mpiexec", "-n", str(nprocs), "python", "-m", "commlib.bench",
                                          *map(str, flags)])
    assert record["columns"] == HEADER
    assert len(record["rows"]) == len(table)
    for row, printed in zip(record["rows"], table):
        assert (row["size"], row["count"], row["dtype"] or "-", row["algorithm"], row["#wrong"]) == \
            (printed["size"], printed["count"], printed["dtype"], printed["algorithm"], printed["wrong"]), row
        assert row["time(us)"] == pytest.approx(printed["time_us"], abs=0.051), row
        assert row["busbw(GB/s)"] == pytest.approx(printed["busbw"], abs=5.1e-4), row
        if row["ratio"] is None:
            assert math.isnan(printed["ratio"]), row
        else:
            assert row["ratio"] == pytest.approx(printed["ratio"], abs=5.1e-3), row


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "int8", "bfloat16"])
def test_bench_table_parses_and_nothing_is_wrong(tmp_path, dtype):
    json_path = tmp_path / "rows.json"
    flags = ["-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1", "-s", "64", "-d", dtype, "--json", json_path]
    result = bench(*flags)
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
    record = read_record(json_path)
    assert_record_is_the_table(record, rows, flags)
    assert all(row["collective"] == "allreduce" and row["hosts"] == [[0, 1]] for row in record["rows"])


@pytest.mark.mpi
def test_bench_times_the_shared_memory_algorithms_on_symmetric_buffers_too():
    result = bench("-b", "8", "-e", "64K", "-f", "64", "-n", "2", "-w", "1", "-a", "shm_oneshot,shm_twoshot,auto",
                   "--symmetric", "--floor")
    rows = parse_table(result.stdout)
    names = ["MPI_Allreduce", "shm_oneshot", "shm_twoshot", "auto", "shm_oneshot@sym", "shm_twoshot@sym", "auto@sym",
             "floor:twoshot"]
    assert [(row["size"], row["algorithm"]) for row in rows] == [(size, name) for size in (8, 512, 32768)
                                                                  for name in names], result.stdout
    # The floor is not an allreduce: unchecked, and left out of the verdict.
    assert all(row["wrong"] == (None if row["algorithm"] == "floor:twoshot" else 0) for row in rows), result.stdout
    assert "out of bounds values: 0 OK" in result.stdout


def test_bench_refuses_a_symmetric_output_where_there_is_none():
    result = subprocess.run([sys.executable, "-m", "commlib.bench", "--collective", "gather", "--symmetric",
                             "--symmetric-output"], cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--symmetric-output: only with --symmetric and --collective" in result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("collective,baseline,factor,suffix", [
    ("broadcast", "MPI_Bcast", 1.0, "@sym"), ("reduce", "MPI_Reduce", 1.0, ""),
    ("allgather", "MPI_Allgather", 0.5, "@symio"), ("reduce_scatter", "MPI_Reduce_scatter_block", 0.5, ""),
    ("alltoall", "MPI_Alltoall", 0.5, "@symio"), ("alltoallv", "MPI_Alltoallv", 0.5, ""),
    ("gather", "MPI_Gather", 0.5, "@sym"), ("scatter", "MPI_Scatter", 0.5, "@symio")])
def test_bench_of_every_collective_checks_its_results(tmp_path, collective, baseline, factor, suffix):
    """Every algorithm of the collective plus auto, after the MPI library's own; busbw by nccl-tests'
    factor (P=2). Where shared-memory algorithms read a symmetric buffer in place, every algorithm
    again on buffers in pg.alloc: ``--symmetric`` the source (rows ``@sym``), ``--symmetric-output``
    the output too (``@symio``, where every rank has one). Every row is checked."""
    import commlib

    json_path = tmp_path / "rows.json"
    symmetric = {"": [], "@sym": ["--symmetric"], "@symio": ["--symmetric", "--symmetric-output"]}[suffix]
    flags = ["--collective", collective, "-b", "8", "-e", "64K", "-f", "32", "-n", "2", "-w", "1", "-s", "64",
             "-d", "int32", *symmetric, "--json", json_path]
    result = bench(*flags)
    rows = parse_table(result.stdout)
    ours = commlib.algorithms(collective) + ["auto"]
    names = [baseline] + ours + ([name + suffix for name in ours] if suffix else [])
    assert [(row["size"], row["algorithm"]) for row in rows] == [(size, name) for size in (8, 256, 8192)
                                                                  for name in names], result.stdout
    for row in rows:
        assert row["wrong"] == 0 and row["time_us"] > 0, row
        assert row["busbw"] == pytest.approx(row["algbw"] * factor, abs=2e-3), row
    record = read_record(json_path)
    assert_record_is_the_table(record, rows, flags)
    assert all(row["collective"] == collective for row in record["rows"])


@pytest.mark.mpi
def test_bench_barrier_row_times_every_algorithm_after_mpi_barrier(tmp_path):
    """No payload: one row per contender, size/count/algbw/busbw 0, dtype '-', and the arrival check."""
    import commlib

    json_path = tmp_path / "rows.json"
    flags = ["--collective", "barrier", "-n", "3", "-w", "1", "--json", json_path]
    result = bench(*flags)
    rows = parse_table(result.stdout)
    assert [row["algorithm"] for row in rows] == ["MPI_Barrier"] + commlib.algorithms("barrier") + ["auto"], \
        result.stdout
    for row in rows:
        assert (row["size"], row["count"], row["dtype"], row["algbw"], row["busbw"], row["wrong"]) == \
            (0, 0, "-", 0.0, 0.0, 0), row
        assert row["time_us"] > 0, row
    assert "barrier exits before a peer arrived: 0 OK" in result.stdout
    record = read_record(json_path)
    assert_record_is_the_table(record, rows, flags)
    assert all(row["dtype"] is None for row in record["rows"])


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs,broken", [(2, "no_wait"), (3, "first_round_only")])
def test_bench_check_catches_a_wrong_result_of_every_collective(tmp_path, nprocs, broken):
    """A barrier that lets ranks out early (returning at once, P=2; dissemination's first round
    alone, enough at P=2, not at P=3), and for every other collective an algorithm with one wrong
    element: #wrong > 0 on its rows and exit status 1; the library's and native on the same run: 0."""
    result = run_mpi("bench_ranks.py", nprocs, "wrong", broken, str(tmp_path), timeout=180)
    assert "wrong results caught for 10 collectives" in result.stdout, result.stdout
    for collective in ("barrier", "allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
                       "alltoallv", "gather", "scatter"):
        record = read_record(tmp_path / f"{collective}.json")
        wrong = {row["algorithm"]: row["#wrong"] for row in record["rows"]}
        culprit = broken if collective == "barrier" else "off_by_one"
        assert set(wrong) == {record["rows"][0]["algorithm"], culprit, "native"}, (collective, wrong)
        assert wrong[culprit] > 0 and all(n == 0 for name, n in wrong.items() if name != culprit), (collective, wrong)
    assert "barrier exits before a peer arrived" in result.stdout and "FAILED" in result.stdout


def test_bench_rejects_bad_arguments():
    result = subprocess.run([sys.executable, "-m", "commlib.bench", "-b", "1M", "-e", "8"],
                            cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "min (1048576) <= max (8)" in result.stderr


DDP_COLUMNS = ["cap MB", "view", "bkts", "ours ms", "mpi ms", "gloo ms", "t/cl ms", "nosync", "local", "ours/gloo",
               "cost/mpi", "hidden", "bufs/g", "extra/g", "rss+/g", "pss+/g"]
OVERLAP = ["--model", "tiny", "--batch", "1", "--caps", "25", "--steps", "1", "--warmup", "1", "--rounds", "1"]
SYNC_METHODS = ["ddp", "powersgd", "localsgd", "partial", "diloco", "streaming-diloco", "desloc", "ddp-adam", "local"]
SYNC = [*SYNC_METHODS, "--model", "tiny", "--batch", "1", "--period", "2", "--steps", "2", "--warmup", "1",
        "--rounds", "1"]


@pytest.fixture(scope="module")
def ddp_benches(tmp_path_factory):
    """``python -m ddp.bench OVERLAP`` and ``python -m ddp.bench --sync SYNC`` at P=2, one job."""
    rows_dir = tmp_path_factory.mktemp("ddp_bench")
    result = run_mpi("bench_ranks.py", 2, "ddp", str(rows_dir), "--", *OVERLAP, "--", *SYNC, timeout=300)
    return result.stdout, read_record(rows_dir / "ddp.json"), read_record(rows_dir / "sync.json"), rows_dir


@pytest.mark.mpi
def test_ddp_bench_runs_every_configuration_and_writes_its_rows(ddp_benches):
    """``python -m ddp.bench`` at P=2, one tiny turn: every column is filled (not a timing test)."""
    stdout, record, _, rows_dir = ddp_benches
    assert record["benchmark"] == "ddp.bench" and record["world_size"] == 2
    assert record["machine"]["torch"] == importlib.metadata.version("torch")  # the torch that ran it
    assert record["command"] == " ".join(["mpiexec -n 2 python -m ddp.bench", *OVERLAP, "--json",
                                          str(rows_dir / "ddp.json")])
    assert record["columns"] == DDP_COLUMNS
    header = [line for line in stdout.splitlines() if line.lstrip().startswith("cap MB")]
    assert header and re.fullmatch(r"\s*" + r"\s+".join(map(re.escape, DDP_COLUMNS)), header[0]), stdout
    rows = record["rows"]
    assert [(row["cap MB"], row["view"]) for row in rows] == [(25, False), (25, True)], rows
    for row in rows:
        for key in ("ours ms", "mpi ms", "gloo ms", "t/cl ms", "nosync", "local", "ours/gloo"):
            assert row[key] > 0, (key, row)
        assert row["bkts"] >= 1 and row["bufs/g"] == pytest.approx(1.0, abs=0.01)
        assert 0 <= row["hidden"] <= 1 and row["model"] == "tiny"
    assert rows[0]["extra/g"] == pytest.approx(1.0, abs=0.01)  # buckets beside the grads
    assert rows[1]["extra/g"] == pytest.approx(0.0, abs=0.01)  # grads are bucket views


@pytest.mark.mpi
def test_ddp_bench_sync_rows_count_the_bytes_of_each_method(ddp_benches):
    """``python -m ddp.bench --sync`` at P=2, one tiny block each: a row per method, and the bytes
    per step say what each sends (not a timing test): ``local`` never averages (the floor row)."""
    stdout, _, record, _ = ddp_benches
    assert record["benchmark"] == "ddp.bench --sync"
    assert record["command"].startswith("mpiexec -n 2 python -m ddp.bench --sync " + " ".join(SYNC))
    assert record["columns"] == ["sync", "ms/step", "vs ddp", "MB/step", "bytes vs", "waited ms/step",
                                 "blocks (ms/step)"]
    rows = {row["sync"]: row for row in record["rows"]}
    assert list(rows) == SYNC_METHODS, rows
    assert all(row["ms/step"] > 0 and len(row["blocks (ms/step)"]) == 1 for row in rows.values()), rows
    assert rows["ddp"]["vs ddp"] == 1.0 and rows["ddp"]["bytes vs"] == 1.0
    assert rows["local"]["MB/step"] == 0, rows["local"]
    assert 0 < rows["powersgd"]["MB/step"] < rows["ddp"]["MB/step"] / 10, rows
    # H=2: one average of the parameters (the gradients' size) every 2 steps
    assert rows["localsgd"]["MB/step"] == pytest.approx(rows["ddp"]["MB/step"] / 2, rel=0.01), rows
    # DiLoCo H=2: the pseudo-gradient every 2 steps; streaming: its 2 fragments one step each; DES-LOC (2, 6, 12):
    # the 2 timed steps (t = 2, 3) hold one average of the parameters; DDP with Adam sends what DDP does.
    for method in ("diloco", "streaming-diloco", "desloc"):
        assert rows[method]["MB/step"] == pytest.approx(rows["ddp"]["MB/step"] / 2, rel=0.01), (method, rows)
    assert rows["ddp-adam"]["MB/step"] == rows["ddp"]["MB/step"], rows
    # The wait is counted for the methods that have one, and only for them (no figure asserted).
    for method, row in rows.items():
        counted = method in ("diloco", "streaming-diloco", "desloc")
        assert (row["waited ms/step"] is not None) == counted, (method, row)
        assert not counted or 0 <= row["waited ms/step"] <= row["ms/step"], (method, row)
    assert "      sync   ms/step   vs ddp" in stdout, stdout


@pytest.mark.mpi
def test_torch_backend_bench_compares_commlib_and_gloo(tmp_path):
    json_path = tmp_path / "bridge.json"
    # A small MLP: the test checks that both backends train and are timed, not how fast.
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "autograd_bridge.bench", "--samples", "3",
               "--steps", "1", "--widths", "256,512,256", "--json", str(json_path)]
    result = subprocess.run(command, cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gloo/commlib" in result.stdout, result.stdout
    rows = json.loads(json_path.read_text())["allreduce"]
    assert rows and all(row["commlib_wrong"] == 0 and row["gloo_wrong"] == 0 for row in rows), rows
    assert all(row["commlib_us"] > 0 and row["gloo_us"] > 0 for row in rows), rows
    ddp = json.loads(json_path.read_text())["ddp"]
    assert set(ddp) == {"commlib", "gloo"} and all(len(row["steps_s"]) == 1 for row in ddp.values()), ddp
