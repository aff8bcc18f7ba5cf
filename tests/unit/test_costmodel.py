"""The cost model: its closed forms, its JSON, its choices, the predict and ddp CLIs (a fit under
mpiexec that writes a model the rest can read: tests/mpi/test_costmodel.py)."""

import json
import subprocess
import sys

import pytest

from commlib import InvalidUsageError
from commlib.costmodel import FORMAT, CostModel, Links, formulas
from tests.support.mpirun import ROOT

# Round numbers so each closed form can be written out by hand.
LINKS = Links(alpha_intra=1e-5, beta_intra=1e-10, alpha_inter=1e-4, beta_inter=8e-9, host_beta_inter=8e-9,
              gamma=2e-10, native_alpha=5e-5, segment_bytes=1 << 20)
N = 64 * 2**20


def close(a, b):
    return a == pytest.approx(b, rel=1e-12)


def test_ring_across_hosts_pays_the_host_boundary_every_step():
    # 2 hosts x 2: 6 steps of n/4, each limited by the one crossing link, + 3 reduces of n/4.
    b = formulas.ring(LINKS, N, 2, 2)
    assert close(b.latency, 6 * 1e-4) and close(b.inter, 6 * N / 4 * 8e-9) and b.intra == 0
    assert close(b.reduce, 3 * N / 4 * 2e-10)
    one_host = formulas.ring(LINKS, N, 1, 4)
    assert close(one_host.total, 6 * (1e-5 + N / 4 * 1e-10) + 3 * N / 4 * 2e-10)
    assert formulas.ring(LINKS, N, 1, 1).total == 0


def test_rabenseifner_crosses_where_its_distance_reaches_the_next_host():
    # 2x2: distance 2 (n/2, two flows per host share the link) crosses, distance 1 (n/4) does not;
    # each round twice (halving and doubling).
    b = formulas.rabenseifner(LINKS, N, 2, 2)
    assert close(b.inter, 2 * max(N / 2 * 8e-9, 2 * N / 2 * 8e-9))
    assert close(b.intra, 2 * N / 4 * 1e-10)
    assert close(b.latency, 2 * 1e-4 + 2 * 1e-5)
    assert close(b.reduce, (N / 2 + N / 4) * 2e-10)


def test_recursive_doubling_and_its_fold():
    b = formulas.recursive_doubling(LINKS, 1000, 2, 1)
    assert close(b.total, 1e-4 + 1000 * 8e-9 + 1000 * 2e-10)
    folded = formulas.recursive_doubling(LINKS, 1000, 1, 3)  # 3 = 2 + 1: fold in and out
    assert close(folded.total, 2 * (1e-5 + 1000 * 1e-10) + 1000 * 2e-10 + (1e-5 + 1000 * 1e-10 + 1000 * 2e-10))


def test_hierarchical_sends_each_byte_across_once_per_host():
    pieces = formulas.hierarchical_pieces(N)
    b = formulas.hierarchical(LINKS, N, 2, 2)
    # Cross: per piece one recursive-doubling exchange of the shard n/(2 pieces), two flows per host.
    assert close(b.inter, pieces * 2 * (N / 2 / pieces) * 8e-9)
    # Inside: one piece's reduce-scatter + allgather is not hidden (2 steps of n/(2 pieces)).
    assert close(b.intra, 2 * N / 2 / pieces * 1e-10)
    assert b.inter < formulas.ring(LINKS, N, 2, 2).inter * 0.7  # n against 1.5 n per host
    single_host = formulas.hierarchical(LINKS, N, 1, 4)
    assert single_host.inter == 0 and close(single_host.latency, 6 * 1e-5)
    per_host_one = formulas.hierarchical(LINKS, N, 4, 1)
    assert per_host_one.intra == 0 and per_host_one.inter > 0


def test_native_uses_the_measured_latency_not_ours():
    tiny = formulas.native(LINKS, 8, 2, 2)
    assert tiny.latency == pytest.approx(5e-5) and tiny.total < formulas.ring(LINKS, 8, 2, 2).total


def model_file(tmp_path, links=LINKS):
    path = tmp_path / "model.json"
    CostModel(links, {"hosts": 2, "ranks_per_host": [2, 2]}).save(path)
    return path


def test_json_round_trip_and_clear_errors(tmp_path):
    path = model_file(tmp_path)
    assert CostModel.load(path).links == LINKS
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT
    data["links"]["inter"]["beta"] = -1
    with pytest.raises(InvalidUsageError, match=r"links.inter.beta must be a finite number >= 0, got -1"):
        CostModel.from_json(data)
    with pytest.raises(InvalidUsageError, match="not a commlib cost model"):
        CostModel.from_json({"links": {}})
    del data["gamma"]
    data["links"]["inter"]["beta"] = 1e-9
    with pytest.raises(InvalidUsageError, match="missing field 'gamma'"):
        CostModel.from_json(data)
    with pytest.raises(InvalidUsageError, match="cannot read it"):
        CostModel.load(tmp_path / "absent.json")


def test_a_fitted_call_overhead_is_added_to_its_algorithm_only(tmp_path):
    import dataclasses

    links = dataclasses.replace(LINKS, call_overhead=(("ring", 1e-3),))
    plain, with_overhead = CostModel(LINKS).predict(8, 2, 2), CostModel(links).predict(8, 2, 2)
    assert with_overhead["ring"].total == pytest.approx(plain["ring"].total + 1e-3)
    assert with_overhead["tree"].total == plain["tree"].total
    assert CostModel(links).predict(8, 1, 1)["ring"].total == 0  # one rank: nothing to pay
    assert CostModel.load(model_file(tmp_path, links)).links.call_overhead == (("ring", 1e-3),)


def test_choices_follow_the_predictions():
    model = CostModel(LINKS)
    assert model.choose(8, 2, 2)[0] == "native"
    best, why = model.choose(N, 2, 2)
    predicted = model.predict(N, 2, 2)
    assert best == min(predicted, key=lambda name: predicted[name].total) == "hierarchical"
    assert "inter-host bytes" in why
    assert model.choose(N, 2, 2, available=["ring", "rabenseifner"])[0] == "ring"
    threshold = model.native_threshold(2, 2)
    assert 8 <= threshold < N and model.choose(threshold * 2, 2, 2)[0] != "native"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "commlib.costmodel", *map(str, args)], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=120)


def test_predict_cli_prints_every_algorithm_and_the_choice(tmp_path):
    path = model_file(tmp_path)
    result = run_cli("predict", "--model", path, "--hosts", 2, "--ranks-per-host", 2, "--bytes", "64M", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(formulas.FORMULAS) <= set(out) and out["choice"] == "hierarchical"
    assert out["hierarchical"] == pytest.approx(CostModel(LINKS).predict(N, 2, 2)["hierarchical"].total)
    table = run_cli("predict", "--model", path, "--hosts", 4, "--ranks-per-host", 8, "--bytes", "8")
    assert table.returncode == 0 and "auto picks native" in table.stdout, table.stdout
    bad = run_cli("predict", "--model", tmp_path / "absent.json", "--hosts", 2, "--ranks-per-host", 2, "--bytes", 8)
    assert bad.returncode == 2 and "cannot read it" in bad.stderr


def test_validate_cli_compares_bench_records_with_the_predictions(tmp_path):
    """Rows of ``python -m commlib.bench --json`` (the one record format): each allreduce row of the
    algorithms asked for, at its hosts' shape, against the model; other collectives' rows skipped."""
    from commlib.bench.record import bench_record, write_record
    from commlib.bench.rows import COLUMNS

    model = CostModel(LINKS)
    hosts = [[0, 1], [2, 3]]

    def row(collective, algorithm, size, seconds):
        return {"size": size, "count": size // 4, "dtype": "float32", "algorithm": algorithm, "time(us)": seconds * 1e6,
                "algbw(GB/s)": 0.0, "busbw(GB/s)": 0.0, "#wrong": 0, "ratio": 1.0, "collective": collective,
                "segment_bytes": 1 << 20, "hosts": hosts}

    ring = model.predict(1 << 20, 2, 2)["ring"].total
    rows = [row("allreduce", "ring", 1 << 20, ring * 1.25), row("allreduce", "tree", 1 << 20, 1.0),
            row("allgather", "ring", 1 << 20, 1.0), row("allreduce", "ring", 8, 1.0)]
    bench = tmp_path / "bench.json"
    write_record(bench, bench_record("commlib.bench", argv=[], world_size=4, columns=[c.name for c in COLUMNS],
                                     rows=rows))
    result = run_cli("validate", "--model", model_file(tmp_path), "--bench", bench, "--algorithms", "ring")
    assert result.returncode == 0, result.stderr
    assert "-20.0%" in result.stdout and "# 1 predictions: median |error| 20.0%" in result.stdout, result.stdout
    old = tmp_path / "old.json"
    old.write_text(json.dumps(rows))  # the bare list --json wrote before the record format
    refused = run_cli("validate", "--model", model_file(tmp_path), "--bench", old)
    assert refused.returncode == 2 and "schema 'list', expected 'commlib-bench/1'" in refused.stderr, refused.stderr


def test_ddp_cli_replays_a_trace_out_to_256_ranks(tmp_path):
    path = model_file(tmp_path)
    png = tmp_path / "scaling.png"
    result = run_cli("ddp", "--model", path, "--trace", ROOT / "tests" / "data" / "ddp_trace.json",
                     "--hosts", "1,2,4,8,16,32", "--ranks-per-host", 8, "--png", png)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line and not line.startswith("#")][1:]
    assert [int(row[1]) for row in rows] == [8, 16, 32, 64, 128, 256]
    efficiencies = [float(row[5]) for row in rows]
    assert all(0 < e <= 1.0 for e in efficiencies) and efficiencies[-1] <= efficiencies[1]
    assert "3 buckets" in result.stdout and png.stat().st_size > 10_000


def test_ddp_profile_comes_from_rank_0s_steps():
    from commlib.costmodel.ddp_scaling import profile_from_trace

    profile = profile_from_trace(ROOT / "tests" / "data" / "ddp_trace.json")
    # Step 0 is dropped: DDP rebuilds its buckets in the order gradients arrived after it.
    assert profile.nbytes == [529960, 73728, 1536] and profile.steps == 5
    assert profile.ready == sorted(profile.ready) and 0 < profile.ready[0] < profile.backward
    assert profile.forward > 0 and profile.optimizer > 0


def test_auto_across_hosts_follows_its_table_or_the_model():
    from commlib.algorithms.registry import algorithm_names
    from commlib.selection.across_hosts import choose_across_hosts, native_threshold_across_hosts
    from commlib.topology import Topology

    names = set(algorithm_names())
    two_by_two, two_by_one = Topology.from_shape(0, [2, 2]), Topology.from_shape(0, [1, 1])
    assert [choose_across_hosts(n, two_by_two, names) for n in (8, 4096, 16384, 4 << 20, 64 << 20)] == \
        ["native", "tree", "tree", "native", "hierarchical"]
    assert [choose_across_hosts(n, two_by_one, names) for n in (8, 8192, 64 << 20)] == \
        ["native", "recursive_doubling", "native"]
    assert native_threshold_across_hosts(two_by_two) == 2048
    assert native_threshold_across_hosts(two_by_two, override="ring") == -1
    assert choose_across_hosts(64 << 20, two_by_two, names - {"hierarchical"}) == "native"
    model = CostModel(LINKS)
    assert choose_across_hosts(64 << 20, two_by_two, names, model) == model.choose(64 << 20, 2, 2)[0]
    assert native_threshold_across_hosts(two_by_two, model=model) == model.native_threshold(2, 2)
