"""A per-host witness process that names the first rank to die without a clean exit.

A rank killed by a signal (SIGKILL, the OOM killer, a segfault) cannot report itself, and the
ranks that could are killed by mpiexec's cleanup a moment later. MPICH's hydra then prints one
PID, and not reliably the right one: with a SIGKILL of rank 1 of 3 it printed rank 0's PID (a
rank its own cleanup had killed) in 4 runs of 12. Reporting from inside the surviving ranks
loses the race against that cleanup (a pidfd watch tried in the survivors, woken by the kernel
the moment the rank died, got its line out in 1 run of 20 before being killed).

So :func:`start_witness` (called once, by :func:`commlib.init`) has the first rank of each host
spawn a small stdlib-only process (:mod:`commlib.reliability.witness_process`) in a session of its
own, which mpiexec's cleanup does not kill. Every rank of the host connects to it over an
abstract Unix socket. A rank says ``bye`` when its interpreter exits normally and ``abort`` when
it reports its own failure (the uncaught-exception hook); a connection that closes without
either means the process died. The kernel closes a dying process's sockets before its parent
even learns of the death, so the witness sees the first death before the cleanup's (measured
3-5 ms ahead) and writes one line naming that rank to the job's stderr. It exits when every
rank of its host has gone. ``COMMLIB_CRASH_WITNESS=0`` turns it off.

The witness also answers ranks on other hosts that time out waiting for one of this host's
ranks (:mod:`commlib.reliability.remote_progress`): each rank hands it its groups' progress boards
(:func:`register_board`), and it tells askers over TCP where those ranks are, even when they are
stuck or dead. :func:`witness_endpoint` is where it listens (exchanged when a group is made).
That port exists only when the job spans hosts, listens only on the addresses that reach the
job's other hosts (or on the interface ``COMMLIB_SOCKET_IFNAME`` names), and answers only
connections that prove the job secret first (the handshake, purpose "witness"; the witness
reads the key from a pipe, never from its command line or environment); :func:`witness_secret`
is the secret askers prove.
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
from typing import List, Optional, Sequence

from commlib.platform.addresses import address_of_interface, interface_addresses, reaching_addresses
from commlib.rendezvous.secret import JobSecret, share_secret

__all__ = ["start_witness", "tell_witness", "witness_command", "witness_endpoint", "witness_secret", "register_board",
           "unregister_board", "query_addresses"]

_WITNESS_SCRIPT = Path(__file__).with_name("witness_process.py")
# What the witness loads by its path (it runs without commlib): the handshake, standard library only.
_HANDSHAKE_CORE = Path(__file__).resolve().parents[1] / "rendezvous" / "handshake_core.py"
WITNESS_READY_SECONDS = 30.0  # the witness's start-up on a loaded machine, with margin
_connection: Optional[socket.socket] = None
_connection_lock = threading.Lock()
_endpoint = ""  # "ADDR,ADDR...:PORT" of this host's witness's query listener; "" when none
_secret: Optional[JobSecret] = None  # what connections to the witnesses of this job prove
_witness_process: Optional[subprocess.Popen] = None  # kept so it is not reaped as garbage


def start_witness(rendezvous, secret: Optional[JobSecret] = None, *, interface: Optional[str] = None,
                  handshake_timeout: float = 10.0) -> bool:
    """Collective over ``rendezvous`` (the world's): start this host's witness and connect to it.

    ``secret``: the job's (None: one made for the witnesses by rank 0 and handed over the
    rendezvous - secure under mpiexec, whose channel nothing outside the job joins); what its
    query port's connections must prove. ``interface`` (``COMMLIB_SOCKET_IFNAME``): where that
    port listens, instead of the addresses that reach the other hosts. Returns whether this rank
    is connected. Failure to start is not an error: the job runs without the witness (mpiexec's
    own report remains).
    """
    global _secret
    if secret is None:
        secret = share_secret(rendezvous, None)
    listen = query_addresses(rendezvous, interface)
    node = rendezvous.host_local()
    try:
        address = b""
        if node.rank == 0:
            address = _spawn(node.size, rendezvous.rank, secret, listen, handshake_timeout)
        address = node.broadcast(address, root=0)
    finally:
        node.close()
    connected = bool(address) and _connect(address, rendezvous.rank, listen)
    if connected:
        _secret = secret
    return connected


def query_addresses(rendezvous, interface: Optional[str] = None) -> List[str]:
    """Collective: where this host's witness listens for the other hosts' questions - nowhere when
    every rank shares this host; ``interface``'s address when given; else the addresses the
    kernel would send from to reach each other host."""
    everyone = rendezvous.allgather((rendezvous.host_name(), interface_addresses()))
    mine = rendezvous.host_name()
    others = {name: addresses for name, addresses in everyone if name != mine and addresses}
    if not any(name != mine for name, _ in everyone):
        return []
    if interface:
        return [address_of_interface(interface)]
    return reaching_addresses(addresses[0] for addresses in others.values())


def witness_command(listener_fd: int, ranks_on_host: int, parent_pid: int, *, secret_fd: int = -1,
                    listen: Sequence[str] = (), handshake_timeout: float = 10.0) -> list:
    """The witness's command line (the argv :mod:`commlib.reliability.witness_process` reads):
    with ``listen`` (addresses) and ``secret_fd`` (a pipe with the job's key), its query port."""
    command = [sys.executable, "-I", "-S", str(_WITNESS_SCRIPT), str(listener_fd), str(ranks_on_host),
               str(parent_pid)]
    if listen and secret_fd >= 0:
        command += ["--listen", ",".join(listen), "--secret-fd", str(secret_fd), "--handshake", str(_HANDSHAKE_CORE),
                    "--handshake-timeout", f"{handshake_timeout:g}"]
    return command


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


def witness_secret() -> Optional[JobSecret]:
    """The secret this job's witnesses answer to (what :mod:`.remote_progress` proves), or None."""
    return _secret


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


def _spawn(ranks_on_host: int, rank: int, secret: JobSecret, listen: Sequence[str], handshake_timeout: float) -> bytes:
    global _witness_process
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Abstract namespace (leading NUL): no file to clean up, gone when the last holder exits.
    address = f"\0commlib-witness-{os.getpid()}-{secrets.token_hex(6)}".encode()
    key_out, key_in = os.pipe() if listen else (-1, -1)
    try:
        listener.bind(address)
        listener.listen(ranks_on_host)
        _witness_process = subprocess.Popen(
            witness_command(listener.fileno(), ranks_on_host, os.getpid(), secret_fd=key_out, listen=listen,
                            handshake_timeout=handshake_timeout),
            pass_fds=[listener.fileno()] + ([key_out] if listen else []), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # outside the job's process group: the cleanup's kill misses it
        )
        if listen:  # the key through a pipe: a command line or an environment others could read
            os.write(key_in, secret.key)
    except OSError as error:
        sys.stderr.write(f"commlib: rank {rank}: crash witness not started ({error}); "
                         f"a rank killed by a signal will be named by mpiexec's PID only\n")
        return b""
    finally:
        listener.close()
        for fd in (key_out, key_in):
            if fd >= 0:
                os.close(fd)
    return address


def _connect(address: bytes, rank: int, listen: Sequence[str]) -> bool:
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
    if port and listen:
        _endpoint = f"{','.join(listen)}:{port}"
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
