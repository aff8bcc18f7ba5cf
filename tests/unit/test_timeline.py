"""The interval arithmetic behind the timeline tool's figures (ddp.timeline), on hand-made spans
(on a real run's trace: tests/mpi/test_timeline.py)."""

import io

from ddp import timeline


def test_interval_arithmetic():
    assert timeline.union([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)]) == [(0, 4), (5, 6)]
    assert timeline.intersect([(0, 4), (5, 9)], [(3, 6), (8, 10)]) == [(3, 4), (5, 6), (8, 9)]
    assert timeline.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert timeline.subtract([(0, 2), (4, 6)], [(-1, 0), (6, 7)]) == [(0, 2), (4, 6)]
    assert timeline.total([(0, 2), (5, 6)]) == 3


def test_step_stats_hidden_excludes_finalize():
    """Allreduce 30-80 over backward 20-90 whose last 20 (finalize) only wait: 40 of 50 hidden."""
    def span(name, ts, dur, cat="compute", **args):
        return {"name": name, "ph": "X", "cat": cat, "pid": 0, "tid": 1, "ts": ts, "dur": dur,
                "args": {"step": 3, **args}}

    trace = {"traceEvents": [
        span("forward", 0, 20), span("backward", 20, 70), span("finalize", 70, 20), span("optimizer", 90, 5),
        span("allreduce", 30, 30, "comm", bucket=0), span("allreduce", 55, 25, "comm", bucket=1),
    ]}
    (stats,) = timeline.step_stats(trace)
    assert (stats.rank, stats.step, stats.buckets) == (0, 3, 2)
    assert stats.comm_us == 50 and stats.hidden_us == 40 and stats.hidden_fraction == 0.8
    assert stats.busy_us == 20 + 50 + 5 and stats.duration_us == 95
    out = io.StringIO()
    timeline.summarize([stats], out=out)
    assert "communication hidden behind computation: 80.0% of 0.050 ms" in out.getvalue()
    assert "slowest rank: rank 0 in 1/1 steps" in out.getvalue()
