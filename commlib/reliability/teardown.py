"""Everything commlib created in MPI is freed before MPI finalizes, without waiting for a peer.

Why: over a real network (MPICH's OFI netmod, ``MPIR_CVAR_CH4_NETMOD=ofi``) an MPI object still
allocated when ``MPI_Finalize`` runs can make finalize fail (a shared-memory window did:
"OFI call fabricclose failed (Device or resource busy)", exit status 15 on every rank, after
correct results). mpi4py finalizes MPI from an ``atexit`` handler registered when ``mpi4py.MPI``
is imported; ours is registered later (the first group is created after that import), and
``atexit`` runs handlers last-in first-out, so ours runs first.

What MPICH 5.0.2 does at exit, measured over OFI/TCP with one rank exiting while its peer still
ran for seconds: ``MPI_Comm_free`` returns at once (also with a request of the peer's pending on
that communicator), and so does ``MPI_Finalize``; ``MPI_Win_free`` is collective and waited
until the peer exited too. So commlib keeps no MPI window (the progress board is plain shared
memory, see :mod:`commlib.reliability.progress_board`) and frees only communicators at exit: a rank that
exits early still exits at once, and its peers' timeouts name it ("its process exited").

At exit, for every group still open, newest first: mark this rank exited on the group's progress
board (first, for all groups, so peers see it as early as possible), then close the group, which
frees its communicator; then free the communicators of groups collected unclosed (below). A group
with a collective still in flight (its communication thread may be inside MPI with that
communicator), or that failed, is left as it is: freeing the communicator under a running call
would be erroneous, and a communicator left allocated does not disturb ``MPI_Finalize``.

A group collected without ``close()`` does not free its communicator inside the collection: a
finalizer runs wherever the collection happens, and mpi4py allocates while it holds its own
module lock (``PyMPI_Lock``, around the attribute table it keeps on communicators), so a
collection there ran ``MPI_Comm_free``, whose attribute callback took that lock again: the
rank deadlocked with itself and its peers waited in the next collective (seen in
``gpu_standin_ranks.py``, about 1 run in 20; gdb showed ``PMPI_Comm_free`` ->
``commlock_free_fn`` waiting on the lock). The finalizer only queues the release
(:func:`release_later`); it runs at the next safe point, on a thread running commlib's own code
and outside any MPI or mpi4py call: the next group created or closed, and at exit.
``MPI_Comm_free`` is local (see above), so ranks may drain their queues at different points.
"""

from __future__ import annotations

import atexit
import collections
import functools
import sys
import threading
import weakref
from typing import Callable, Deque, List

__all__ = ["free_at_exit", "release_later", "run_released_later"]

_lock = threading.Lock()
_groups: List[weakref.ref] = []  # oldest first
_installed = False
# Releases queued by finalizers: a deque, since append and popleft need no lock (a finalizer may
# run during a collection on a thread that holds _lock: it must never wait for anything).
_queued: Deque[Callable[[], None]] = collections.deque()


def free_at_exit(group, release) -> None:
    """Close ``group`` (a :class:`commlib.ProcessGroup`) at interpreter exit, before MPI finalizes.

    Call right after creating the group's communicator (``mpi4py.MPI`` is imported by then, so
    this handler runs before mpi4py's finalize). A group garbage-collected before exit without
    ``close()`` has ``release()`` called in the collection (what ties it to its ranks: a socket
    mesh's goodbye; an MPI communicator's free, which must be a :func:`release_later`);
    ``release`` must not hold a reference to the group.
    """
    global _installed
    run_released_later()  # a group is being created: a safe point (see the module docstring)
    with _lock:
        _groups[:] = [ref for ref in _groups if ref() is not None]
        _groups.append(weakref.ref(group))
        if not _installed:
            atexit.register(_close_groups_at_exit)
            _installed = True
    freed_when_collected = weakref.finalize(group, release)
    freed_when_collected.atexit = False  # at exit, _close_groups_at_exit handles live groups


def release_later(release: Callable[[], None]) -> Callable[[], None]:
    """What a finalizer should call instead of ``release``, when ``release`` calls MPI: it
    queues ``release`` for :func:`run_released_later` and returns at once."""
    return functools.partial(_queued.append, release)


def run_released_later() -> None:
    """Run the queued releases, oldest first. Call only from a safe point: commlib's own code, no
    MPI or mpi4py call of this thread in progress. A release that fails is reported on stderr
    and the others still run: freeing a collected group's communicator must not fail the
    unrelated group whose creation or close drains the queue."""
    while True:
        try:
            release = _queued.popleft()
        except IndexError:
            return
        try:
            release()
        except Exception as exc:  # noqa: BLE001 - reported; the rest of the queue must still run
            print(f"commlib: freeing a group collected without close() failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)


def _close_groups_at_exit() -> None:
    from mpi4py import MPI

    with _lock:
        groups = [group for group in (ref() for ref in reversed(_groups)) if group is not None]
        _groups.clear()
    if MPI.Is_finalized():
        return
    for group in groups:
        board = group.progress
        if board is not None:
            board.mark_exited()
    for group in groups:
        # A failed group may have a call stuck in MPI on its communicator (a split left behind
        # at its deadline): freeing it under that call would be erroneous. Leaving it is harmless.
        if group.closed or group.executor.pending() or group.executor.first_error is not None:
            continue
        try:
            group.close()
        except Exception:  # noqa: BLE001 - exit must go on: a failure here must not keep MPI from finalizing
            pass
    run_released_later()
