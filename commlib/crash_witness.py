"""A per-host witness process that names the first rank to die without a clean exit.

A rank killed by a signal (SIGKILL, the OOM killer, a segfault) cannot report itself, and the
ranks that could are killed by mpiexec's cleanup a moment later. MPICH's hydra then prints one
PID, and not reliably the right one: with a SIGKILL of rank 1 of 3 it printed rank 0's PID (a
rank its own cleanup had killed) in 4 runs of 12. Reporting from inside the surviving ranks
loses the race against that cleanup (a pidfd watch tried in the survivors, woken by the kernel
the moment the rank died, got its line out in 1 run of 20 before being killed).

So :func:`start_witness` (called once, by :func:`commlib.init`) has the first rank of each host
spawn a small stdlib-only process (:mod:`commlib.crash_witness_process`) in a session of its
own, which mpiexec's cleanup does not kill. Every rank of the host connects to it over an
abstract Unix socket. A rank says ``bye`` when its interpreter exits normally and ``abort`` when
it reports its own failure (the uncaught-exception hook); a connection that closes without
either means the process died. The kernel closes a dying process's sockets before its parent
even learns of the death, so the witness sees the first death before the cleanup's (measured
3-5 ms ahead) and writes one line naming that rank to the job's stderr. It exits when every
rank of its host has gone. ``COMMLIB_CRASH_WITNESS=0`` turns it off.

The witness also answers ranks on other hosts that time out waiting for one of this host's
ranks (:mod:`commlib.remote_progress`): each rank hands it its groups' progress boards
(:func:`register_board`), and it tells askers over TCP where those ranks are, even when they are
stuck or dead. :func:`witness_endpoint` is where it listens (exchanged when a group is made).
"""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

__all__ = ["start_witness", "tell_witness", "witness_command", "witness_endpoint", "register_board",
           "unregister_board"]

_WITNESS_SCRIPT = Path(__file__).with_name("crash_witness_process.py")
WITNESS_READY_SECONDS = 30.0  # the witness's start-up on a loaded machine, with margin
_connection: Optional[socket.socket] = None
_connection_lock = threading.Lock()
_endpoint = ""  # "ADDR,ADDR...:PORT" of this host's witness's query listener; "" when none
_witness_process: Optional[subprocess.Popen] = None  # kept so it is not reaped as garbage


def start_witness(comm) -> bool:
    """Collective over ``comm`` (the world): start this host's witness and connect to it.

    Returns whether this rank is connected. Failure to start is not an error: the job runs
    without the witness (mpiexec's own report remains).
    """
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        address = b""
        if node.Get_rank() == 0:
            address = _spawn(node.Get_size(), comm.Get_rank())
        address = node.bcast(address, root=0)
    finally:
        node.Free()
    return bool(address) and _connect(address, comm.Get_rank())


def witness_command(listener_fd: int, ranks_on_host: int, parent_pid: int) -> list:
    """The witness's command line (the argv :mod:`commlib.crash_witness_process` reads)."""
    return [sys.executable, "-I", "-S", str(_WITNESS_SCRIPT), str(listener_fd), str(ranks_on_host),
            str(parent_pid)]


def tell_witness(message: bytes) -> None:
    """Send ``b"bye"`` (clean exit) or ``b"abort"`` (this rank reports its own failure)."""
    connection = _connection
    if connection is None:
        return
    try:
        with _connection_lock:
            connection.sendall(message + b"\n")
    except OSError:
        pass
    if message == b"bye":
        _forget()


def witness_endpoint() -> str:
    """Where this host's witness answers queries from other hosts (``"ADDR,...:PORT"``), or ""."""
    return _endpoint


def register_board(key: str, group_rank: int, slot: int, fd: int) -> None:
    """Hand this rank's progress board of group ``key`` to the witness (``fd`` is duplicated)."""
    connection = _connection
    if connection is None:
        return
    try:
        with _connection_lock:
            socket.send_fds(connection, [f"board {key} {group_rank} {slot}\n".encode()], [fd])
    except OSError:
        pass


def unregister_board(key: str) -> None:
    """This rank's group ``key`` was closed while the process goes on."""
    connection = _connection
    if connection is None:
        return
    try:
        with _connection_lock:
            connection.sendall(f"unboard {key}\n".encode())
    except OSError:
        pass


def _spawn(ranks_on_host: int, rank: int) -> bytes:
    global _witness_process
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Abstract namespace (leading NUL): no file to clean up, gone when the last holder exits.
    address = f"\0commlib-witness-{os.getpid()}-{secrets.token_hex(6)}".encode()
    try:
        listener.bind(address)
        listener.listen(ranks_on_host)
        _witness_process = subprocess.Popen(
            witness_command(listener.fileno(), ranks_on_host, os.getpid()),
            pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True,  # outside the job's process group: the cleanup's kill misses it
        )
    except OSError as error:
        sys.stderr.write(f"commlib: rank {rank}: crash witness not started ({error}); "
                         f"a rank killed by a signal will be named by mpiexec's PID only\n")
        return b""
    finally:
        listener.close()
    return address


def _connect(address: bytes, rank: int) -> bool:
    global _connection, _endpoint
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
        connection.sendall(f"hello {rank} {os.getpid()} {socket.gethostname()}\n".encode())
        # Wait until the witness watches this connection: a job that fails within the witness's
        # start-up (~50 ms) would otherwise die unwatched (measured: 2 runs of 6 lost the line
        # when a rank exited during the first collectives).
        connection.settimeout(WITNESS_READY_SECONDS)
        reply = b""
        while not reply.endswith(b"\n") and len(reply) < 16:
            chunk = connection.recv(16 - len(reply))
            if not chunk:
                break
            reply += chunk
        words = reply.split()
        ready = reply.endswith(b"\n") and words[:1] == [b"ok"]
        port = int(words[1]) if ready and len(words) > 1 and words[1].isdigit() else 0
        connection.settimeout(None)
    except OSError:
        ready = False
    if not ready:
        connection.close()
        sys.stderr.write(f"commlib: rank {rank}: the crash witness did not answer within "
                         f"{WITNESS_READY_SECONDS:g} s; a rank killed by a signal will be named by "
                         f"mpiexec's PID only\n")
        return False
    _connection = connection
    if port:
        from .root_address import interface_addresses

        addresses = interface_addresses()
        _endpoint = f"{','.join(addresses)}:{port}" if addresses else ""
    atexit.register(tell_witness, b"bye")
    # A forked child (a DataLoader worker) would hold the connection open after this rank died,
    # and the witness would see the death late. (Under hydra the child also holds the rank's PMI
    # socket, which delays mpiexec's cleanup just as much, so no test here can tell the
    # difference; other launchers may not.)
    os.register_at_fork(after_in_child=_forget)
    return True


def _forget() -> None:
    global _connection, _endpoint
    _endpoint = ""
    connection, _connection = _connection, None
    if connection is not None:
        try:
            connection.close()
        except OSError:
            pass
