"""torch's modern stack on the "commlib" backend, bit for bit against gloo, under real mpiexec.

Two jobs (a torch import costs seconds per rank, so each runs every check of
``tests/mpi/torch_stack``): P=4, with HSDP on a 2x2 mesh, writing a distributed checkpoint, and
P=2 with ml_dtypes blocked, loading that checkpoint resharded to 2 ranks.
"""

import pytest

from tests.support.mpirun import ROOT, run_mpi

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("torch_stack")
    result = run_mpi("torch_stack_ranks.py", 4, "--checkpoints", str(directory), "--save-for-resharding",
                     timeout=400)
    return directory, result


@pytest.mark.mpi
def test_torch_stack_at_4_ranks_with_hsdp(four_ranks):
    _, result = four_ranks
    assert "OK:" in result.stdout, result.stdout[-3000:]


@pytest.mark.mpi
def test_torch_stack_at_2_ranks_without_ml_dtypes_loading_the_4_rank_checkpoint(four_ranks):
    directory, _ = four_ranks
    result = run_mpi("torch_stack_ranks.py", 2, "--checkpoints", str(directory), "--load-resharded",
                     "--without-ml-dtypes", timeout=300)
    assert "OK:" in result.stdout, result.stdout[-3000:]


@pytest.mark.mpi
def test_stack_benchmark_runs_and_writes_its_tables(tmp_path):
    """The benchmark (not a timing test): every table, both backends, the shared JSON format."""
    from commlib.bench.record import read_record

    path = tmp_path / "stack.json"
    small = ("--steps", "1", "--samples", "1", "--iters", "2", "--widths", "32,64,32", "--sizes", "8192",
             "--sparse-rows", "1000")
    result = run_mpi(ROOT / "autograd_bridge" / "bench" / "stack.py", 2, *small, "--json", str(path), timeout=240)
    tables = {name: read_record(tmp_path / f"stack-{name}.json") for name in ("fsdp", "dtensor", "sparse")}
    for name, record in tables.items():
        assert record["schema"] == "commlib-bench/1" and record["world_size"] == 2, record
        assert record["rows"] and all(set(record["columns"]) <= set(row) for row in record["rows"]), (name, record)
    backends = [row["backend"] for row in tables["fsdp"]["rows"]]
    assert backends == ["commlib", "gloo"] and all(row["calls"] > 0 for row in tables["fsdp"]["rows"])
    # Every DTensor row has torch's own cost beside the two backends (the no-communication group).
    assert [row["what"] for row in tables["dtensor"]["rows"]] == [
        "redistribute", "funcol all_gather", "all_gather_into_tensor"], tables["dtensor"]
    assert all(row["floor us"] > 0 and row["gloo/floor"] > 0 for row in tables["dtensor"]["rows"]), tables["dtensor"]
    assert "gloo/commlib" in result.stdout
