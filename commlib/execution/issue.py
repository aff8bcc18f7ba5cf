"""What every collective does first, whichever group (CPU or GPU) and thread runs it.

A collective gets its sequence number from the executor when it starts (:mod:`.executor`); then,
before any byte moves, it

1. marks this rank's slot on the progress board (``(seq, collective)``: what peers that time out
   read to name who is behind),
2. starts the transport's collective context (deadline = now + the group's timeout; what every
   wait and error message reads), and
3. in debug mode, compares its fingerprint with every rank's (:mod:`.fingerprint`).

The CPU group and the GPU backend both call :func:`begin_collective`, so the two paths cannot
drift apart.
"""

from __future__ import annotations

from typing import Callable, Optional

from commlib.execution.fingerprint import CallFingerprint, FingerprintChecker

__all__ = ["begin_collective", "collective_task"]


def begin_collective(seq: int, collective: str, algorithm: str, nbytes: int, fingerprint: CallFingerprint, *,
                     context, timeout: float, progress, fingerprints: Optional[FingerprintChecker]) -> None:
    """Steps 1-3 of the module docstring for collective number ``seq`` (``context``: the
    transport's :class:`~commlib.transports.interface.CollectiveContext`; ``progress``: the group's
    progress board or None; ``fingerprints``: the debug checker or None)."""
    if progress is not None:
        progress.started(seq, collective)
    context.begin(collective, seq, algorithm, nbytes, timeout)
    if fingerprints is not None:
        fingerprints.check(collective, seq, algorithm, fingerprint)


def collective_task(run: Callable, transport, collective: str, algorithm: str, nbytes: int,
                    fingerprint: CallFingerprint, *, timeout: float, progress,
                    fingerprints: Optional[FingerprintChecker]) -> Callable[[int], None]:
    """``task(seq)`` for the executor: :func:`begin_collective`, then ``run(transport)``."""
    context = transport.context

    def task(seq: int) -> None:
        begin_collective(seq, collective, algorithm, nbytes, fingerprint, context=context, timeout=timeout,
                         progress=progress, fingerprints=fingerprints)
        run(transport)

    return task
