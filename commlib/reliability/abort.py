"""Turning one rank's uncaught exception into the end of the whole job, with its cause on stderr.

Without this, the failing rank's interpreter exits through ``MPI_Finalize`` while its peers sit
in a collective waiting for it, and the job ends only when their timeout fires (or never, for a
user's own blocking MPI call). We say which rank failed and why, print the traceback, and call
``MPI_Abort`` so mpiexec tears every rank down at once with a non-zero status.

The cause must survive the teardown. ``MPI_Abort`` makes mpiexec kill every rank, and what a
rank wrote that its launcher had not yet read from the stderr pipe is lost with it: measured
with MPICH's hydra at P=3, the cause line (then the traceback's last line) was missing in 1 run of
12 when two ranks timed out together and one's abort killed the other mid-traceback. So:

* the cause (rank, host, exception type and message: the collective, its sequence number, the
  peers never heard from) comes first, as **one line in one** ``write`` (atomic on a pipe up to
  ``PIPE_BUF``), before the traceback;
* before aborting, the rank waits (bounded) until its launcher has read its stderr pipe empty,
  and a short grace for peers failing at the same moment to get their own lines out (measured
  with ``scripts/fault_lines.py``, P=3, 30 runs per mode: with the wait every timed-out rank's
  line was there in every run; without it some runs kept only 1 of 3, though always at least
  one: the one-line write alone already kept *a* cause line in 150 of 150 runs).
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import struct
import sys
import termios
import time

__all__ = ["install_abort_on_uncaught_exception", "cause_line", "wait_until_stderr_read"]

_installed = False
# One write() of at most PIPE_BUF bytes reaches a pipe whole, never interleaved with another's.
_LINE_LIMIT = 4000
DRAIN_TIMEOUT_SECONDS = 2.0
PEER_GRACE_SECONDS = 0.2


def cause_line(rank_text: str, where: str, exc_type, exc) -> bytes:
    """One line naming this rank, its host and the exception (message newlines folded)."""
    message = " | ".join(part for part in str(exc).splitlines() if part.strip()) or "(no message)"
    line = (f"commlib: rank {rank_text} on {socket.gethostname()} failed with an uncaught exception "
            f"{where}: {exc_type.__name__}: {message}; aborting the MPI job")
    encoded = line.encode(errors="replace")
    if len(encoded) > _LINE_LIMIT:
        encoded = encoded[:_LINE_LIMIT - 5] + b" [..]"
    return encoded + b"\n"


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            written = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:
            return
        data = data[written:]


def wait_until_stderr_read(deadline: float, fd: int = 2) -> bool:
    """If ``fd`` is a pipe, wait until its reader emptied it (or ``deadline``); True when empty.

    FIONREAD on either end of a Linux pipe counts the bytes not yet read.
    """
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return True
        pending = bytearray(4)
        while True:
            fcntl.ioctl(fd, termios.FIONREAD, pending)
            if struct.unpack("i", bytes(pending))[0] == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(1e-3)
    except OSError:
        return True


def _abort(rank_text: str, exc_type, exc, tb, where: str) -> None:
    import traceback

    from mpi4py import MPI

    from commlib.reliability.crash_witness import tell_witness

    tell_witness(b"abort")  # this rank names itself below; the deaths that follow are the cleanup
    try:
        sys.stderr.flush()  # what the program printed before comes first
    except Exception:  # noqa: BLE001 - a broken stderr must not stop the abort
        pass
    _write_all(2, cause_line(rank_text, where, exc_type, exc))
    try:
        traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    wait_until_stderr_read(time.monotonic() + DRAIN_TIMEOUT_SECONDS)
    time.sleep(PEER_GRACE_SECONDS)
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
