"""Process-wide state: the default ("world") group, created once by :func:`init`."""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional

from commlib.config import GPU_TRANSPORTS, load_config
from commlib.errors import CommTimeoutError, InvalidUsageError
from commlib.group.process_group import ProcessGroup
from commlib.group.validation import check_timeout
from commlib.platform.launcher import detect_launcher
from commlib.rendezvous.mpi import MPIRendezvous

__all__ = ["init", "world", "is_initialized", "shutdown", "empty", "group_over_store"]

_lock = threading.Lock()
_world: Optional[ProcessGroup] = None
_store = None  # the store init opened (not one handed in), closed at shutdown


def init(comm=None, timeout: Optional[float] = None, *, debug: Optional[bool] = None,
         segment_bytes: Optional[int] = None, device: Optional[int] = None,
         gpu_transport: Optional[str] = None, abort_on_exception: bool = True, store=None,
         init_method: Optional[str] = None, rank: Optional[int] = None,
         world_size: Optional[int] = None) -> ProcessGroup:
    """Create the default ("world") group. Idempotent.

    **Under mpiexec** (or with ``comm``): over ``comm`` (default ``MPI.COMM_WORLD``), dup'ed.
    **Without MPI** (torchrun, ``torch.multiprocessing.spawn``, any launcher that sets ``RANK``
    and ``WORLD_SIZE``; or when ``store`` or ``init_method`` is given): the ranks meet through a
    store and talk over sockets (shared memory within a host). Where to meet: ``store`` (ours, or
    a torch ``c10d.Store``), else ``init_method`` (``tcp://HOST:PORT``, ``file:///path``,
    ``env://``), else ``COMMLIB_STORE``, else ``MASTER_ADDR``/``MASTER_PORT`` (see
    :mod:`commlib.rendezvous.launch`); ``rank`` and ``world_size`` default to ``RANK`` and
    ``WORLD_SIZE``. A launch whose ranks disagree (world sizes, a rank claimed twice, a rank that
    never comes) ends on every rank within ``timeout`` with an error that names the variable or
    the rank.

    ``timeout`` (seconds) bounds every collective of the group; default ``COMMLIB_TIMEOUT`` or
    300. ``debug`` (default ``COMMLIB_DEBUG``) checks before each collective that all ranks call
    the same one with the same arguments. With ``abort_on_exception`` an uncaught exception on
    one rank aborts the whole MPI job instead of leaving the other ranks blocked (without MPI
    the dying rank's sockets close, and its peers end in ``PeerExitedError``). ``device`` picks
    this rank's GPU (default: rank on the host modulo visible GPUs) and ``gpu_transport``
    (``"nccl"`` or ``"host_staged"``; default ``COMMLIB_GPU_TRANSPORT`` or nccl) how CuPy arrays move.
    """
    global _world
    config = load_config()
    timeout = check_timeout(config.timeout if timeout is None else timeout, "commlib.init")
    if gpu_transport is not None and gpu_transport not in GPU_TRANSPORTS:
        raise InvalidUsageError(f"commlib.init: gpu_transport {gpu_transport!r}: expected one of "
                                f"{', '.join(GPU_TRANSPORTS)}")
    options = dict(timeout=timeout, config=config, debug=config.debug if debug is None else debug, name="world",
                   segment_bytes=segment_bytes, device=device, gpu_transport=gpu_transport)
    with _lock:
        if _world is not None:
            return _world
        without_mpi = comm is None and (store is not None or init_method is not None
                                        or detect_launcher() == "env")
        if without_mpi:
            _world = _init_without_mpi(store, init_method, rank, world_size, options)
        else:
            if store is not None or rank is not None or world_size is not None:
                raise InvalidUsageError("commlib.init: comm and store/rank/world_size exclude each other (under "
                                        "mpiexec the ranks are MPI's)")
            _world = _init_with_mpi(comm, abort_on_exception, options)
        if _world.debug:
            _print_rank_map(_world)
        return _world


def _init_with_mpi(comm, abort_on_exception: bool, options) -> ProcessGroup:
    from mpi4py import MPI

    from commlib.platform.machine import note_ranks_on_machine

    config, timeout = options["config"], options["timeout"]
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
    # Before any group waits: how the waits poll depends on it (see commlib/platform/machine.py).
    note_ranks_on_machine(MPIRendezvous(dup))
    # The job's secret before anything listens (the witness's query port answers only whoever
    # proves it): COMMLIB_JOB_SECRET(_FILE) checked alike on every rank, else rank 0's, over MPI.
    secret = _job_secret(MPIRendezvous(dup), config)
    if config.crash_witness and dup.Get_size() > 1:
        from commlib.reliability.crash_witness import start_witness

        start_witness(MPIRendezvous(dup), secret, interface=config.socket_interface)
    world = ProcessGroup(dup, **options)
    if abort_on_exception:
        from commlib.reliability.abort import install_abort_on_uncaught_exception

        install_abort_on_uncaught_exception()
    return world


def _init_without_mpi(store, init_method: Optional[str], rank: Optional[int], world_size: Optional[int],
                      options) -> ProcessGroup:
    """The world of ranks that meet through a store (see :func:`init`)."""
    global _store
    from commlib.rendezvous.launch import LaunchEnvironment, open_store
    from commlib.rendezvous.secret import configured_secret

    config, timeout = options["config"], options["timeout"]
    launch = LaunchEnvironment.from_env()
    rank = launch.rank if rank is None else rank
    world_size = launch.world_size if world_size is None else world_size
    if rank is None or world_size is None:
        missing = [name for name, value in (("RANK", rank), ("WORLD_SIZE", world_size)) if value is None]
        raise InvalidUsageError(f"commlib.init without MPI: {' and '.join(missing)} not set (pass rank= and "
                                f"world_size=, or launch with torchrun or mpiexec)")
    if store is None:
        store, _where = open_store(init_method or config.store, launch, rank, configured_secret(config),
                                   timeout=timeout, config=config)
        _store = store  # ours to close at shutdown (rank 0's is the server)
    return group_over_store(store, rank, world_size, world=True, **options)


def group_over_store(store, rank: int, size: int, *, timeout: float, config=None, name: str = "world",
                     prefix: Optional[str] = None, world: bool = False, **options) -> ProcessGroup:
    """Collective over the ``size`` processes that pass ``store`` (ours, or a torch ``c10d.Store``
    such as the one ``dist.init_process_group`` hands a backend): a group of them, meeting
    through the store (under ``prefix``: default this launch's, see
    :mod:`commlib.rendezvous.launch`) and talking over sockets, with shared memory among the
    ranks of a host. ``world``: it is the job's first group (it also notes how many ranks share
    this machine and starts the crash witness). The job secret is ``COMMLIB_JOB_SECRET`` /
    ``COMMLIB_JOB_SECRET_FILE``, else rank 0's, handed over the store."""
    from commlib.platform.machine import note_ranks_on_machine
    from commlib.rendezvous.launch import LaunchEnvironment, meet
    from commlib.transports.socket import SocketOptions, SocketTransport

    config = load_config() if config is None else config
    timeout = check_timeout(timeout, "group_over_store")
    launch = LaunchEnvironment.from_env()
    rendezvous = meet(store, rank, size, launch, timeout=timeout, world=world,
                      prefix=prefix or (launch.prefix() if world else f"{launch.prefix()}/{name}"))
    secret = _job_secret(rendezvous, config)
    if world:
        note_ranks_on_machine(rendezvous)
        if config.crash_witness and size > 1:
            from commlib.reliability.crash_witness import start_witness

            start_witness(rendezvous, secret, interface=config.socket_interface)
    transport = SocketTransport(rendezvous, secret, options=SocketOptions.from_config(config), timeout=timeout,
                                name=name)
    return ProcessGroup(transport=transport, timeout=timeout, config=config, name=name, **options)


def _job_secret(rendezvous, config):
    """Collective: the job's secret (:func:`commlib.rendezvous.secret.share_secret`). A rank whose
    own setting is unusable (too short, a file others may read) fails every rank, naming it: the
    others would otherwise wait for it in the exchange (under MPI: forever)."""
    from commlib.rendezvous.secret import configured_secret, share_secret

    try:
        configured, problem = configured_secret(config), None
    except InvalidUsageError as error:
        configured, problem = None, str(error)
    problems = rendezvous.allgather(problem)
    bad = [f"rank {rank}: {text}" for rank, text in enumerate(problems) if text]
    if bad:
        raise InvalidUsageError(f"rank {rendezvous.rank}: the job secret is unusable on {len(bad)} rank(s): "
                                + "; ".join(bad))
    return share_secret(rendezvous, configured)


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
    from commlib.platform.waiting import wait_all

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
    global _world, _store
    with _lock:
        if _world is not None:
            _world.close()
            _world = None
        store, _store = _store, None
        if store is not None:
            store.close()
