"""Turning one rank's uncaught exception into the end of the whole job.

Without this, the failing rank's interpreter exits through ``MPI_Finalize`` while its peers sit
in a collective waiting for it, and the job ends only when their timeout fires (or never, for a
user's own blocking MPI call). We print the traceback, say which rank failed, and call
``MPI_Abort`` so mpiexec tears every rank down at once with a non-zero status.
"""

from __future__ import annotations

import sys

__all__ = ["install_abort_on_uncaught_exception"]

_installed = False


def _abort(rank_text: str, exc_type, exc, tb, where: str) -> None:
    import traceback

    from mpi4py import MPI

    from .crash_witness import tell_witness

    tell_witness(b"abort")  # this rank names itself below; the deaths that follow are the cleanup
    sys.stderr.write(f"commlib: rank {rank_text} failed with an uncaught exception {where}; "
                     f"aborting the MPI job\n")
    traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


def install_abort_on_uncaught_exception() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from mpi4py import MPI

    rank_text = f"{MPI.COMM_WORLD.Get_rank()}/{MPI.COMM_WORLD.Get_size()}"
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt) or MPI.COMM_WORLD.Get_size() == 1:
            previous_hook(exc_type, exc, tb)
            return
        _abort(rank_text, exc_type, exc, tb, "in the main thread")

    sys.excepthook = excepthook
