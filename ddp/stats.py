"""Per-step communication statistics: how much allreduce time backward hid.

The buckets of one group run one after another on its communication thread, so bucket k really
starts when it was launched or when bucket k-1 finished, whichever is later; its busy time ends
when its ``Work`` completed (``Work.completed_at``, stamped by the completing thread). The part of
that busy time before backward ended (the final callback started) was overlapped with compute;
``hidden_fraction`` is that part over the whole.
"""

from __future__ import annotations

__all__ = ["StepStats"]


class StepStats:
    @staticmethod
    def from_buckets(buckets, backward_start, backward_end: float, finalize_end: float) -> dict:
        comm = overlapped = 0.0
        previous_done = None
        launched = 0
        for bucket in buckets:
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
        }
