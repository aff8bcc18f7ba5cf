"""The benchmark's parts that need no peers: the spec table, each spec's closed form and check,
the ``--json`` record, the two-shot floor.

Each spec's inputs and expected results are checked against the collective computed here by its
definition with numpy, over every rank's inputs at once (world sizes 1-5, every op); then one
element of a result is changed and the spec's check must count it.
"""

import json
import re
import sys

import numpy as np
import pytest

from commlib.algorithms.registry import COLLECTIVES
from commlib.bench.record import SCHEMA, bench_record, command_line, read_record, write_record
from commlib.bench.specs import ROOT, SPECS, ClosedFormCheck, Shape
from commlib.bench.table import Column, format_line, header_line

DATA_COLLECTIVES = [name for name in SPECS if SPECS[name].payload]
OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def test_every_collective_of_the_registry_has_a_spec():
    assert set(SPECS) == set(COLLECTIVES)
    for name, spec in SPECS.items():
        assert spec.name == name and spec.baseline.startswith("MPI_"), spec
    # nccl-tests' bus factors (PERFORMANCE.md) at P=4
    assert {name: spec.bus_factor(4) for name, spec in SPECS.items()} == {
        "allreduce": 1.5, "broadcast": 1.0, "reduce": 1.0, "allgather": 0.75, "reduce_scatter": 0.75,
        "alltoall": 0.75, "alltoallv": 0.75, "gather": 0.75, "scatter": 0.75, "barrier": 0.0}


def _reduced(arrays, op):
    total = arrays[0].astype(np.int64)
    for array in arrays[1:]:
        total = OPS[op](total, array.astype(np.int64))
    return total


def by_definition(name, buffers, size, op):
    """Each rank's output of ``name``, computed from every rank's inputs (``buffers[r]``)."""
    inputs = [b.inp for b in buffers]
    pristine = [b.pristine for b in buffers]
    if name == "allreduce":
        return [_reduced(pristine, op)] * size
    if name == "broadcast":
        return [pristine[ROOT]] * size
    if name == "reduce":
        return [_reduced(pristine, op) if r == ROOT else pristine[r] for r in range(size)]
    if name in ("allgather", "gather"):
        gathered = np.concatenate(inputs)
        return [gathered if name == "allgather" or r == ROOT else buffers[r].out for r in range(size)]
    block = buffers[0].out.size if name in ("reduce_scatter", "scatter") else inputs[0].size // size
    if name == "reduce_scatter":
        total = _reduced(inputs, op)
        return [total[r * block:(r + 1) * block] for r in range(size)]
    if name == "scatter":
        return [inputs[ROOT][r * block:(r + 1) * block] for r in range(size)]
    if name == "alltoall":
        return [np.concatenate([inputs[i][j * block:(j + 1) * block] for i in range(size)]) for j in range(size)]
    assert name == "alltoallv"
    pieces = []  # pieces[i][j]: what rank i sends rank j, cut by i's in_counts
    for b in buffers:
        edges = np.cumsum([0, *b.counts[1]])
        pieces.append([b.inp[edges[j]:edges[j + 1]] for j in range(size)])
    return [np.concatenate([pieces[i][j] for i in range(size)]) for j in range(size)]


def writes(buffers, result):
    """A stand-in for the collective's call on one rank: it leaves ``result`` in the output."""
    return lambda: np.copyto(buffers.out, result)


@pytest.mark.parametrize("name", DATA_COLLECTIVES)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_each_spec_expects_what_the_collective_computes_and_its_check_counts_a_wrong_element(name, size):
    spec = SPECS[name]
    for op in ("sum", "prod", "min", "max") if spec.reducing else ("sum",):
        for requested in (1, 7, 64):
            count = spec.count(requested, size)
            buffers = [spec.init(Shape(rank, size, count, np.dtype(np.int32), op)) for rank in range(size)]
            results = by_definition(name, buffers, size, op)
            caught = 0
            for rank, (b, result) in enumerate(zip(buffers, results)):
                assert b.out.shape == b.pristine.shape == b.expected.shape == result.shape, (name, rank)
                check = ClosedFormCheck()
                assert check.wrong_after(writes(b, result), b) == 0, (name, size, op, rank)
                if result.size:
                    wrong = result.astype(b.out.dtype)
                    wrong[rank % wrong.size] += 1
                    assert check.wrong_after(writes(b, wrong), b) == 1, (name, size, op, rank)
                    caught += 1
                    # The reset puts the input back: a call that writes nothing is wrong where the
                    # result differs from the input.
                    assert check.wrong_after(lambda: None, b) == int(np.count_nonzero(b.pristine != result))
            assert caught >= 1, (name, size)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_alltoallv_blocks_are_uneven_and_every_rank_sends_and_receives_the_row_count(size):
    spec = SPECS["alltoallv"]
    count = spec.count(64 * size, size)
    for rank in range(size):
        b = spec.init(Shape(rank, size, count, np.dtype(np.float32)))
        out_counts, in_counts = b.counts
        assert sum(out_counts) == sum(in_counts) == count == b.inp.size == b.out.size
        assert len(set(in_counts)) > 1 and len(set(out_counts)) > 1


def test_the_block_collectives_report_whole_blocks():
    for name in ("allgather", "reduce_scatter", "alltoall", "alltoallv", "gather", "scatter"):
        assert [SPECS[name].count(n, 3) for n in (1, 2, 3, 10)] == [3, 3, 3, 9], name
    assert [SPECS["allreduce"].count(n, 3) for n in (1, 10)] == [1, 10]
    assert SPECS["barrier"].count(10, 3) == 0


def test_a_table_line_prints_its_row_under_its_header():
    columns = (Column("size", 6, "d"), Column("time(us)", 9, ".1f"), Column("hidden", 6, ".2f", "n/a"),
               Column("view", 5, "s"), Column("blocks", 8, lambda ms: " ".join(f"{m:.0f}" for m in ms)))
    assert header_line(columns) == "  size  time(us) hidden  view   blocks"
    line = format_line(columns, {"size": 8, "time(us)": 12.345, "hidden": None, "view": True, "blocks": [3.2, 4.7]})
    assert line == "     8      12.3    n/a  True      3 5"
    assert len(line) == len(header_line(columns))


def test_the_record_has_the_one_format(tmp_path):
    rows = [{"size": 8, "time(us)": 1.5, "ratio": float("nan"), "hosts": [[0, 1]]}, {"size": 64, "time(us)": 2.0,
                                                                                    "ratio": 1.0, "hosts": [[0, 1]]}]
    record = bench_record("commlib.bench", argv=["-b", "8", "-a", "ring,native", "--json", "out dir/r.json"],
                          world_size=3, columns=["size", "time(us)", "ratio"], rows=rows, notes="smoke")
    assert list(record) == ["schema", "benchmark", "command", "date", "machine", "world_size", "notes", "columns",
                            "rows"]
    assert record["schema"] == SCHEMA == "commlib-bench/1" and record["world_size"] == 3
    assert record["command"] == "mpiexec -n 3 python -m commlib.bench -b 8 -a ring,native --json 'out dir/r.json'"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"]) and record["notes"] == "smoke"
    machine = record["machine"]
    assert {"cpu", "cores", "memory_gib", "python", "numpy", "mpi"} <= set(machine), machine
    assert machine["cores"] >= 1 and machine["memory_gib"] > 0 and machine["mpi"]
    # The torch that ran the benchmark, where one did (never imported by the record itself).
    assert ("torch" in machine) == ("torch" in sys.modules)
    path = tmp_path / "r.json"
    write_record(path, record)
    loaded = json.loads(path.read_text())  # plain JSON: no NaN
    assert loaded["rows"][0]["ratio"] is None and loaded["rows"][1] == rows[1]
    assert read_record(path) == loaded
    # One row a line (the checked-in files diff by rows).
    assert sum(1 for line in path.read_text().splitlines() if line.lstrip().startswith('{"size"')) == 2


def test_the_record_names_the_launch_of_a_flagged_benchmark():
    record = bench_record("ddp.bench --sync", module="ddp.bench", argv=["--sync", "ddp"], world_size=2,
                          columns=[], rows=[])
    assert record["command"] == "mpiexec -n 2 python -m ddp.bench --sync ddp"
    assert command_line("commlib.bench", [], 1) == "mpiexec -n 1 python -m commlib.bench"


def test_the_record_refuses_a_row_without_a_column_and_a_file_of_another_format(tmp_path):
    with pytest.raises(ValueError, match=r"row 1 has no value for column\(s\) \['ratio'\]"):
        bench_record("x", argv=[], world_size=1, columns=["size", "ratio"],
                     rows=[{"size": 1, "ratio": 1.0}, {"size": 2}])
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"size": 8, "time_us": 1.0}]))  # what --json wrote before the format
    with pytest.raises(ValueError, match="schema 'list', expected 'commlib-bench/1'"):
        read_record(old)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad\.json: not a benchmark record"):
        read_record(tmp_path / "bad.json")


@pytest.mark.parametrize("size,rank", [(2, 0), (2, 1), (3, 2), (5, 1)])
def test_the_two_shot_floor_does_the_two_shot_work_on_every_element(size, rank):
    """Its reduce reads the stand-in P - 1 times into this rank's slice and every other slice is
    copied from that slice, so from zeros and a stand-in of ones every element ends at P - 1 (odd
    lengths, several rounds)."""
    from commlib.bench.floor import twoshot_floor
    from commlib.ops import ReduceOp

    for count in (size, 1001, 40_003):
        buf = np.zeros(count, np.float32)
        twoshot_floor(buf, np.ones(count, np.float32), rank, size, ReduceOp.SUM, round_bytes=16 << 10)()
        assert np.array_equal(buf, np.full(count, size - 1, np.float32)), (count, np.unique(buf))


@pytest.mark.parametrize("size", [2, 3, 5])
def test_the_push_floor_reduces_and_writes_every_element_on_exactly_one_rank(size):
    """The symmetric buffers' schedule: each rank reduces its chunks (P - 1 reads of the stand-in)
    and copies them into the P - 1 destinations where the collective writes its peers; over the
    ranks, every element of every round is done exactly once (odd lengths, several rounds)."""
    from commlib.bench.floor import twoshot_floor
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
