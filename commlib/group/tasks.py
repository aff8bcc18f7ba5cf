"""The ``run(transport)`` a collective method hands the executor: the algorithm on its arguments.

Functions of their own rather than closures in each method: a method whose body defines a
closure creates the cells of every variable the closure captures on each call, before its first
line, so the small-message fast path at its top would pay for them too (10-15 ns each, a tenth
of a microsecond per collective).
"""

from __future__ import annotations

__all__ = ["algorithm_task", "allreduce_task"]


def algorithm_task(fn, args: tuple, segment_bytes: int, *, average=None, size: int = 1, shared=None):
    """Algorithm ``fn`` on ``args`` (against the shared-memory transport ``shared`` when it needs
    one), then ``average /= size`` when given (AVG, where the algorithm summed)."""
    def run(transport):
        fn(shared or transport, *args, segment_bytes=segment_bytes)
        if average is not None:
            average[...] /= size

    return run


def allreduce_task(fn, flat, combine, segment_bytes: int, size: int, shared, *, divide: bool):
    """allreduce ``flat`` with algorithm ``fn`` and op ``combine`` (against ``shared`` when it needs
    it), then divide by ``size`` for an AVG the algorithm summed (``divide``)."""
    def run(transport):
        if size > 1:
            fn(shared or transport, flat, combine, segment_bytes=segment_bytes)
        if divide:
            flat[...] /= size  # in place: flat is a view of the caller's buffer

    return run
