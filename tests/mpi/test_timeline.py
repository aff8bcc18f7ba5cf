"""The trace of a real 2-rank training run (Trace Event Format, every bucket on every rank), and
the timeline tool that reads it (figures, PNG); its interval arithmetic: tests/unit/test_timeline.py."""

import json
import math
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.support.mpirun import ROOT
from tests.support.torch_job import TORCH_JOB, TRACE_BATCH, trace_path, traced_training

from ddp import timeline

# small_cnn of train_digits.py: conv 1->32 (3x3), conv 32->64 (3x3), linear 1024->128, linear 128->10.
CNN_PARAMETERS = (32 * 9 + 32) + (64 * 32 * 9 + 64) + (1024 * 128 + 128) + (128 * 10 + 10)


TRAIN_SAMPLES = 1797 - 360
BATCH = TRACE_BATCH


def steps_per_epoch(ranks):
    return math.ceil(math.ceil(TRAIN_SAMPLES / ranks) / BATCH)  # the sampler pads to a multiple of ranks


def traced(ranks):
    """The trace of one training epoch on ``ranks`` ranks (a part of the session's torch job)."""
    TORCH_JOB.check(ranks, *traced_training(ranks))
    return ranks, trace_path(ranks)


@pytest.fixture(scope="module", params=(2, 3))
def traced_run(request):
    return traced(request.param)


@pytest.mark.mpi
def test_trace_is_trace_event_format_with_every_bucket_on_every_rank(traced_run):
    ranks, trace_path = traced_run
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for event in events:
        assert {"ph", "pid", "tid", "name"} <= event.keys(), event
        assert event["ph"] in ("X", "i", "M"), event
        if event["ph"] != "M":
            assert isinstance(event["ts"], (int, float)) and event["ts"] >= -1e3, event  # near rank 0's zero
        if event["ph"] == "X":
            assert event["dur"] >= 0, event
    assert {e["pid"] for e in events} == set(range(ranks))
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(r, lane) for r in range(ranks) for lane in ("compute", "comm")} <= names

    ready = defaultdict(set)      # (rank, step) -> buckets
    reduced = defaultdict(dict)   # (rank, step) -> bucket -> bytes
    spans = defaultdict(set)      # (rank, step) -> span names
    for e in events:
        if e["ph"] == "M":
            continue
        key = (e["pid"], e["args"]["step"])
        spans[key].add(e["name"])
        if e["name"] == "bucket_ready":
            ready[key].add(e["args"]["bucket"])
        elif e["name"] == "allreduce":
            assert e["cat"] == "comm" and e["args"]["algorithm"], e
            reduced[key][e["args"]["bucket"]] = e["args"]["bytes"]
    steps = {step for _, step in spans}
    assert steps == set(range(steps_per_epoch(ranks))), steps
    for rank in range(ranks):
        for step in steps:
            key = (rank, step)
            assert {"forward", "backward", "optimizer", "finalize"} <= spans[key], (key, spans[key])
            buckets = set(reduced[key])
            assert len(buckets) >= 3 and buckets == set(range(len(buckets))) == ready[key], (key, buckets, ready[key])
            # Every gradient byte is in exactly one bucket's allreduce, every step, on every rank.
            assert sum(reduced[key].values()) == 4 * CNN_PARAMETERS, (key, reduced[key])
    assert trace["otherData"]["ranks"] == ranks and len(trace["otherData"]["clock_offset_us"]) == ranks
    # One host, one CLOCK_MONOTONIC: the true offset is 0, and min-RTT ping-pong guarantees the
    # estimate is within half the round trip of it (+ rounding to 1 ns in the file).
    for offset, bound in zip(trace["otherData"]["clock_offset_us"], trace["otherData"]["clock_error_bound_us"]):
        assert abs(offset) <= bound + 0.01, (offset, bound)


@pytest.mark.mpi
def test_timeline_figures(traced_run):
    ranks, trace_path = traced_run
    stats = timeline.step_stats(timeline.load_trace(trace_path))
    assert len(stats) == ranks * steps_per_epoch(ranks)
    assert all(s.comm_us > 0 and s.buckets >= 3 and 0.0 <= s.hidden_fraction <= 1.0 for s in stats)
    assert all(s.hidden_us <= s.comm_us and s.busy_us <= s.duration_us for s in stats)


@pytest.mark.mpi
def test_timeline_cli_prints_figures_and_writes_the_png(tmp_path):
    _, trace = traced(2)
    png = tmp_path / "overlap.png"
    result = subprocess.run([sys.executable, "-m", "ddp.timeline", str(trace), "--png", str(png)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "communication hidden behind computation:" in result.stdout
    assert "slowest rank: rank" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
