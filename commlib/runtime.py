"""Process-wide state: the default ("world") group, created once by :func:`init`."""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional

from .config import GPU_TRANSPORTS, load_config
from .errors import CommTimeoutError, InvalidUsageError
from .group import ProcessGroup
from .validation import check_timeout

__all__ = ["init", "world", "is_initialized", "shutdown", "empty"]

_lock = threading.Lock()
_world: Optional[ProcessGroup] = None


def init(comm=None, timeout: Optional[float] = None, *, debug: Optional[bool] = None,
         segment_bytes: Optional[int] = None, device: Optional[int] = None,
         gpu_transport: Optional[str] = None, abort_on_exception: bool = True) -> ProcessGroup:
    """Create the default group over ``comm`` (default ``MPI.COMM_WORLD``), dup'ed. Idempotent.

    ``timeout`` (seconds) bounds every collective of the group; default ``COMMLIB_TIMEOUT`` or
    300. ``debug`` (default ``COMMLIB_DEBUG``) checks before each collective that all ranks call
    the same one with the same arguments. With ``abort_on_exception`` an uncaught exception on
    one rank aborts the whole MPI job instead of leaving the other ranks blocked. ``device``
    picks this rank's GPU (default: rank on the host modulo visible GPUs) and ``gpu_transport``
    (``"nccl"`` or ``"host_staged"``; default ``COMMLIB_GPU_TRANSPORT`` or nccl) how CuPy arrays move.
    """
    global _world
    from .machine import note_ranks_on_machine

    config = load_config()
    timeout = check_timeout(config.timeout if timeout is None else timeout, "commlib.init")
    if gpu_transport is not None and gpu_transport not in GPU_TRANSPORTS:
        raise InvalidUsageError(f"commlib.init: gpu_transport {gpu_transport!r}: expected one of "
                                f"{', '.join(GPU_TRANSPORTS)}")
    with _lock:
        if _world is not None:
            return _world
        from mpi4py import MPI

        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise InvalidUsageError(
                f"commlib needs MPI_THREAD_MULTIPLE (its communication thread calls MPI while the "
                f"main thread may too); this MPI library provided level {provided}"
            )
        parent = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(parent, MPI.Comm) or parent == MPI.COMM_NULL:
            raise InvalidUsageError(f"commlib.init: comm must be an mpi4py communicator, got {comm!r}")
        dup = _dup_with_deadline(parent, timeout)
        # Before any group waits: how the waits poll depends on it (see commlib/machine.py).
        note_ranks_on_machine(dup)
        if config.crash_witness and dup.Get_size() > 1:
            from .crash_witness import start_witness

            start_witness(dup)
        _world = ProcessGroup(dup, timeout=timeout, config=config,
                              debug=config.debug if debug is None else debug, name="world",
                              segment_bytes=segment_bytes, device=device,
                              gpu_transport=gpu_transport)
        if abort_on_exception:
            from .abort import install_abort_on_uncaught_exception

            install_abort_on_uncaught_exception()
        if _world.debug:
            _print_rank_map(_world)
        return _world


def _print_rank_map(group: ProcessGroup) -> None:
    """Debug mode: rank 0 prints which process is which rank and host.

    A rank killed by a signal cannot report itself, and mpiexec names the dead process by PID
    only; this line turns that PID back into a rank.
    """
    import os
    import socket

    import numpy as np

    record = f"{group.rank}:{os.getpid()}@{socket.gethostname()}".encode()
    width = 96
    mine = np.zeros(width, np.uint8)
    mine[:min(len(record), width)] = np.frombuffer(record[:width], np.uint8)
    gathered = np.empty(width * group.size, np.uint8)
    group.allgather(gathered, mine)
    if group.rank == 0:
        entries = [bytes(gathered[r * width:(r + 1) * width]).rstrip(b"\0").decode() for r in range(group.size)]
        sys.stderr.write("commlib: rank:pid@host " + " ".join(entries) + "\n")
        sys.stderr.flush()


def _dup_with_deadline(parent, timeout: float):
    """``MPI_Comm_idup`` waited with a deadline: a rank that never calls init is an error, not a hang."""
    from .transports.polling import wait_all

    dup, request = parent.Idup()
    if not wait_all([request], time.monotonic() + timeout):
        raise CommTimeoutError(
            f"rank {parent.Get_rank()}: commlib.init timed out after {timeout:g} s waiting for "
            f"the other {parent.Get_size() - 1} rank(s) to call init"
        )
    return dup


def world() -> ProcessGroup:
    if _world is None:
        raise InvalidUsageError("commlib.world(): call commlib.init() first")
    return _world


def empty(shape, dtype="float32", group: Optional[ProcessGroup] = None):
    """A symmetric buffer of ``group`` (default: the world group): ``group.alloc(shape, dtype)``."""
    return (group if group is not None else world()).alloc(shape, dtype)


def is_initialized() -> bool:
    return _world is not None


def shutdown() -> None:
    """Stop the default group's communication thread (optional; a daemon thread ends with Python)."""
    global _world
    with _lock:
        if _world is not None:
            _world.close()
            _world = None
