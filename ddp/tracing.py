"""A timeline of training steps on every rank, written as one Chrome/Perfetto trace.

DDP and the training loop report what happens, with ``time.perf_counter()`` times:

* ``span(name, lane, start, end, args)``: forward, backward, optimizer (the loop), finalize
  (DDP, lane "compute"), one "allreduce" per bucket (DDP's communication thread, lane "comm");
* ``instant(name, lane, ts, args)``: "bucket_ready", when autograd filled a bucket;
* ``set_step(i)``: step ``i`` starts now; every event is attributed to the step during which
  it started (by time, so a span the communication thread reports late still lands in its step).

``write(path)`` is collective: every rank sends its events to rank 0, which writes one JSON
file in the Trace Event Format (pid = rank, tid = lane), readable by chrome://tracing and
ui.perfetto.dev, and by ``python -m ddp.timeline``.

Clocks. Ranks on different hosts have unrelated ``perf_counter`` origins, and even on one host
a few microseconds of skew would misplace a bucket's allreduce against its peer's. At
construction (collective) each rank measures its offset to rank 0 by ping-pong: the exchange
with the smallest round trip bounds the error by half that round trip (NTP's rule). Times in
the file are microseconds since rank 0 created the tracer, on rank 0's clock.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import pickle
import threading
import time
from typing import Dict, List, Optional

import numpy as np

__all__ = ["Tracer", "NullTracer", "LANES"]

# Lanes in display order; their index is the tid. Other lanes get the next free tid.
LANES = ("steps", "compute", "comm")
PING_ROUNDS = 8
ALIGN_TIMEOUT_S = 60.0
# Point-to-point tags of the tracer's own messages (high in the user range, away from small ones).
TRACE_TAGS = {"ping": 29_101, "pong": 29_102, "origin": 29_103, "length": 29_104, "events": 29_105}


class Tracer:
    """Collects events on this rank; ``write`` merges all ranks into one trace (collective).

    Construction and :meth:`write` are collective over ``process_group``: they talk through the
    group's point-to-point channel (which never mixes with its collectives, and takes no place in
    their order), on tags of their own (``TRACE_TAGS``; a program's own point-to-point messages
    must not use them while a tracer is created or written).
    """

    def __init__(self, process_group=None, *, rounds: int = PING_ROUNDS):
        if process_group is None:
            import commlib

            process_group = commlib.world()
        self.group = process_group
        self.rank = process_group.rank
        self.size = process_group.size
        self._lock = threading.Lock()
        self._events: List[tuple] = []
        self._step_starts: List[float] = []
        self._steps: List[int] = []
        self.offset, self.rtt = self._align_clock(max(1, int(rounds)))
        # Rank 0's "now" after alignment is time zero of the trace.
        self.origin = self._from_rank_0(time.perf_counter())

    # -- recording (any thread) ---------------------------------------------------------------
    def set_step(self, step: int, ts: Optional[float] = None) -> None:
        ts = time.perf_counter() if ts is None else ts
        with self._lock:
            self._step_starts.append(ts)
            self._steps.append(int(step))

    def span(self, name: str, lane: str, start: float, end: float, args: Optional[dict] = None) -> None:
        with self._lock:
            self._events.append(("X", name, lane, start, end, args))

    def instant(self, name: str, lane: str, ts: float, args: Optional[dict] = None) -> None:
        with self._lock:
            self._events.append(("i", name, lane, ts, ts, args))

    @contextlib.contextmanager
    def region(self, name: str, lane: str = "compute", **args):
        """Record the ``with`` block as a span."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.span(name, lane, start, time.perf_counter(), args or None)

    # -- output (collective) ------------------------------------------------------------------
    def local_events(self) -> List[dict]:
        """This rank's events in the Trace Event Format, on rank 0's clock (no metadata)."""
        with self._lock:
            events = list(self._events)
            step_starts = list(self._step_starts)
            steps = list(self._steps)
        shift = self.offset - self.origin
        out = []
        for ph, name, lane, start, end, args in events:
            record = {"name": name, "ph": ph, "cat": lane, "pid": self.rank, "tid": _tid(lane),
                      "ts": round((start + shift) * 1e6, 3)}
            if ph == "X":
                record["dur"] = round(max(0.0, end - start) * 1e6, 3)
            else:
                record["s"] = "t"
            record["args"] = dict(args or {})
            index = bisect.bisect_right(step_starts, start) - 1
            if index >= 0:
                record["args"]["step"] = steps[index]
            out.append(record)
        out.extend(self._step_spans(self.rank, step_starts, steps, events, shift))
        return out

    def write(self, path) -> Optional[dict]:
        """Gather every rank's events to rank 0 and write ``path`` there; returns the trace on rank 0."""
        gathered = self._gather_to_rank_0((self.local_events(), self.offset, self.rtt))
        if gathered is None:
            return None
        trace_events = []
        for rank in range(self.size):
            trace_events.extend(_metadata(rank))
        for events, _, _ in gathered:
            trace_events.extend(events)
        trace = {
            "traceEvents": trace_events,
            "displayTimeUnit": "ms",
            "otherData": {
                "producer": "commlib-ddp ddp.tracing",
                "ranks": self.size,
                "clock": "perf_counter of each rank, shifted onto rank 0's by min-RTT ping-pong",
                "clock_offset_us": [round(offset * 1e6, 3) for _, offset, _ in gathered],
                "clock_error_bound_us": [round(rtt * 1e6 / 2, 3) for _, _, rtt in gathered],
            },
        }
        path = os.fspath(path)
        temporary = f"{path}.tmp{os.getpid()}"
        with open(temporary, "w") as handle:
            json.dump(trace, handle)
        os.replace(temporary, path)
        return trace

    def close(self) -> None:
        """Nothing to release (kept so callers may close a tracer as they close a file)."""

    # -- internals ----------------------------------------------------------------------------
    @staticmethod
    def _step_spans(rank, step_starts, steps, events, shift):
        """One "step N" span per step on the "steps" lane, until the next step or the last event."""
        last_end = max((end for _, _, _, _, end, _ in events), default=None)
        spans = []
        for index, (start, step) in enumerate(zip(step_starts, steps)):
            end = step_starts[index + 1] if index + 1 < len(step_starts) else last_end
            if end is None or end < start:
                continue
            spans.append({"name": f"step {step}", "ph": "X", "cat": "steps", "pid": rank,
                          "tid": _tid("steps"), "ts": round((start + shift) * 1e6, 3),
                          "dur": round((end - start) * 1e6, 3), "args": {"step": step}})
        return spans

    def _align_clock(self, rounds: int):
        """(offset to add to local times to get rank 0's, best round trip) by ping-pong with rank 0."""
        group = self.group
        group.monitored_barrier(ALIGN_TIMEOUT_S)  # start together: nobody's first ping waits on a late peer
        if self.size == 1:
            return 0.0, 0.0
        stamp = np.zeros(1, dtype=np.float64)
        if self.rank == 0:
            # Peers one after the other, so no reply waits behind another peer's ping.
            for peer in range(1, self.size):
                for _ in range(rounds):
                    group.recv(stamp, peer, TRACE_TAGS["ping"], timeout=ALIGN_TIMEOUT_S)
                    stamp[0] = time.perf_counter()
                    group.send(stamp, peer, TRACE_TAGS["pong"], timeout=ALIGN_TIMEOUT_S)
            return 0.0, 0.0
        best_rtt, best_offset = float("inf"), 0.0
        reply = np.zeros(1, dtype=np.float64)
        for _ in range(rounds):
            sent = time.perf_counter()
            receive = group.irecv(reply, 0, TRACE_TAGS["pong"], timeout=ALIGN_TIMEOUT_S)
            group.send(stamp, 0, TRACE_TAGS["ping"], timeout=ALIGN_TIMEOUT_S)
            receive.wait()
            received = time.perf_counter()
            if received - sent < best_rtt:
                best_rtt = received - sent
                best_offset = float(reply[0]) - (sent + received) / 2
        return best_offset, best_rtt

    def _from_rank_0(self, value: float) -> float:
        """Rank 0's ``value`` on every rank."""
        box = np.array([value], dtype=np.float64)
        if self.rank == 0:
            for peer in range(1, self.size):
                self.group.send(box, peer, TRACE_TAGS["origin"], timeout=ALIGN_TIMEOUT_S)
        else:
            self.group.recv(box, 0, TRACE_TAGS["origin"], timeout=ALIGN_TIMEOUT_S)
        return float(box[0])

    def _gather_to_rank_0(self, record) -> Optional[list]:
        """Every rank's ``record`` (pickled) on rank 0, in rank order; None elsewhere."""
        group = self.group
        if self.rank != 0:
            payload = np.frombuffer(pickle.dumps(record), dtype=np.uint8)
            group.send(np.array([payload.size], np.int64), 0, TRACE_TAGS["length"], timeout=ALIGN_TIMEOUT_S)
            group.send(payload, 0, TRACE_TAGS["events"], timeout=ALIGN_TIMEOUT_S)
            return None
        gathered = [record]
        for peer in range(1, self.size):
            length = np.zeros(1, np.int64)
            group.recv(length, peer, TRACE_TAGS["length"], timeout=ALIGN_TIMEOUT_S)
            payload = np.empty(int(length[0]), np.uint8)
            group.recv(payload, peer, TRACE_TAGS["events"], timeout=ALIGN_TIMEOUT_S)
            gathered.append(pickle.loads(payload.tobytes()))
        return gathered

class NullTracer:
    """The tracer's interface, recording nothing (tracing off)."""

    def set_step(self, step, ts=None):
        pass

    def span(self, name, lane, start, end, args=None):
        pass

    def instant(self, name, lane, ts, args=None):
        pass

    @contextlib.contextmanager
    def region(self, name, lane="compute", **args):
        yield

    def write(self, path):
        return None

    def close(self):
        pass


def _tid(lane: str) -> int:
    if lane in LANES:
        return LANES.index(lane)
    # Stable across ranks and runs (hash() of a str is salted per process).
    return len(LANES) + sum(lane.encode()) % 1000


def _metadata(rank: int) -> List[Dict]:
    records = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    for lane in LANES:
        records.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": _tid(lane), "args": {"name": lane}})
        records.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": _tid(lane),
                        "args": {"sort_index": _tid(lane)}})
    return records

