"""Per-step communication statistics: how much allreduce time backward hid, and how many bytes.

Time. The buckets of one group run one after another on its communication thread, so bucket k
really starts when it was launched or when bucket k-1 finished, whichever is later; its busy time
ends when its ``Work`` completed (``Work.completed_at``, stamped by the completing thread). The
part of that busy time before backward ended (the final callback started) was overlapped with
compute; ``hidden_fraction`` is that part over the whole.

Bytes. ``bytes_sent`` is the payload a bucket's reduction handed to collectives: the bucket for
a plain allreduce, the low-rank factors for PowerSGD, nothing for a local step. It is what the
compression formulas count (PowerSGD: sum of (n + m) r over the compressed matrices plus the
uncompressed elements, times the element size), not what the wire carries, which depends on the
algorithm (a ring allreduce of n bytes sends 2 (P - 1) / P n bytes per rank). A hook's
collectives are counted when they go through ``bucket.process_group`` or a group the hook passed
through ``bucket.metered(group)`` (the built-in hooks do); collectives a user hook issues on
other objects are not seen.
"""

from __future__ import annotations

import threading

__all__ = ["StepStats", "ByteCounter", "MeteredGroup"]


class ByteCounter:
    """A running total of payload bytes; safe to add to from the communication thread."""

    __slots__ = ("_total", "_lock")

    def __init__(self):
        self._total = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._total += int(nbytes)

    @property
    def total(self) -> int:
        return self._total

    def reset(self) -> None:
        with self._lock:
            self._total = 0


def _nbytes(array) -> int:
    return int(getattr(array, "nbytes", 0))


class MeteredGroup:
    """A commlib group that adds the payload of every collective issued through it to a counter.

    Everything else (``rank``, ``size``, ``new_group``...) is the wrapped group's. Counting is at
    issue time, from the caller's own arrays, so it is what was really handed to the runtime.
    """

    __slots__ = ("group", "counter")

    def __init__(self, group, counter: ByteCounter):
        self.group = group
        self.counter = counter

    def __getattr__(self, name):
        return getattr(self.group, name)

    def __repr__(self) -> str:
        return f"<MeteredGroup over {self.group!r}>"

    def allreduce(self, buf, *args, **kwargs):
        self.counter.add(_nbytes(buf))
        return self.group.allreduce(buf, *args, **kwargs)

    def broadcast(self, buf, *args, **kwargs):
        self.counter.add(_nbytes(buf))
        return self.group.broadcast(buf, *args, **kwargs)

    def reduce(self, buf, *args, **kwargs):
        self.counter.add(_nbytes(buf))
        return self.group.reduce(buf, *args, **kwargs)

    def allgather(self, out, inp, *args, **kwargs):
        self.counter.add(_nbytes(inp))
        return self.group.allgather(out, inp, *args, **kwargs)

    def reduce_scatter(self, out, inp, *args, **kwargs):
        self.counter.add(_nbytes(inp))
        return self.group.reduce_scatter(out, inp, *args, **kwargs)


class StepStats:
    @staticmethod
    def from_buckets(buckets, backward_start, backward_end: float, finalize_end: float) -> dict:
        comm = overlapped = 0.0
        previous_done = None
        launched = 0
        bytes_per_bucket = []
        for bucket in buckets:
            bytes_per_bucket.append(bucket.sent.total)
            if bucket.launched_at is None or bucket.done_at is None:
                continue
            launched += 1
            start = bucket.launched_at if previous_done is None else max(bucket.launched_at, previous_done)
            busy = max(0.0, bucket.done_at - start)
            comm += busy
            overlapped += max(0.0, min(bucket.done_at, backward_end) - start)
            previous_done = bucket.done_at
        return {
            "buckets": launched,
            "comm_s": comm,
            "overlapped_comm_s": overlapped,
            "hidden_fraction": overlapped / comm if comm > 0 else 0.0,
            "backward_s": (backward_end - backward_start) if backward_start is not None else 0.0,
            "finalize_s": finalize_end - backward_end,
            "bytes_sent": sum(bytes_per_bucket),
            "bytes_per_bucket": bytes_per_bucket,
        }
