"""The crash witness's protocol, driven directly (the mpiexec side is in test_reliability.py).

Each test starts the real witness process on a listening socket and plays the ranks with plain
sockets: ``hello`` then ``bye`` (clean exit), ``abort`` (the rank reported itself) or a close
without either (the process died).
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from commlib import crash_witness

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")


class Witness:
    def __init__(self, ranks: int):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.address = f"\0commlib-witness-test-{os.getpid()}-{time.monotonic_ns()}".encode()
        self.listener.bind(self.address)
        self.listener.listen(ranks)
        self.process = subprocess.Popen(
            crash_witness.witness_command(self.listener.fileno(), ranks, os.getpid()),
            pass_fds=[self.listener.fileno()], stderr=subprocess.PIPE, text=True)
        self.listener.close()

    def rank(self, rank: int, pid: int = 0) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.address)
        connection.sendall(f"hello {rank} {pid or 1000 + rank} testhost\n".encode())
        connection.settimeout(10)
        reply = connection.recv(16)
        assert reply.startswith(b"ok ") and reply.endswith(b"\n"), "the witness answers once it watches the connection"
        connection.settimeout(None)
        return connection

    def finish(self) -> str:
        _, stderr = self.process.communicate(timeout=10)
        assert self.process.returncode == 0, stderr
        return stderr


def _say(connection: socket.socket, word: bytes) -> None:
    connection.sendall(word + b"\n")
    connection.close()


def test_names_the_first_rank_that_closes_without_a_clean_exit_and_only_it():
    witness = Witness(3)
    ranks = [witness.rank(r) for r in range(3)]
    time.sleep(0.2)
    ranks[1].close()  # died
    time.sleep(0.2)
    ranks[0].close()  # the cleanup's kill: not named
    _say(ranks[2], b"bye")
    stderr = witness.finish()
    assert stderr.count("crash witness") == 1, stderr
    assert "rank 1 (pid 1001 on testhost) ended without a clean exit" in stderr, stderr
    assert "the first rank on testhost to fail" in stderr


def test_deaths_seen_late_are_still_named_in_the_order_they_happened():
    # A loaded machine: the witness gets no CPU while the killed rank and then the cleanup's
    # victims close. Stopped here on purpose, so all closes wait for it at once.
    witness = Witness(4)
    ranks = [witness.rank(r) for r in range(4)]
    os.kill(witness.process.pid, signal.SIGSTOP)
    try:
        for index in (2, 0, 3, 1):  # rank 2 died first; the others are the cleanup
            ranks[index].close()
    finally:
        os.kill(witness.process.pid, signal.SIGCONT)
    stderr = witness.finish()
    assert stderr.count("crash witness") == 1, stderr
    assert "rank 2 (pid 1002 on testhost) ended without a clean exit" in stderr, stderr


def test_a_clean_job_and_a_self_reported_failure_stay_silent():
    witness = Witness(2)
    first, second = witness.rank(0), witness.rank(1)
    _say(first, b"bye")
    _say(second, b"bye")
    assert witness.finish() == ""

    witness = Witness(3)
    ranks = [witness.rank(r) for r in range(3)]
    _say(ranks[2], b"abort")  # the rank printed its own traceback and called MPI_Abort
    time.sleep(0.2)
    ranks[0].close()
    ranks[1].close()
    assert witness.finish() == ""


def test_a_rank_that_dies_before_hello_is_named_by_its_kernel_pid():
    witness = Witness(1)
    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); "
        f"s.connect({witness.address!r}); sys.exit(0)")])
    child.wait(timeout=10)
    stderr = witness.finish()
    assert f"rank ? (pid {child.pid} on" in stderr, stderr


def test_exits_when_its_parent_has_gone_and_no_rank_ever_connected():
    # Stand-in for local rank 0: a process that starts the witness and exits before any rank connects.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"\0commlib-witness-test-orphan-{os.getpid()}".encode())
    listener.listen(1)
    script = (f"import os, subprocess; from commlib.crash_witness import witness_command; "
              f"subprocess.Popen(witness_command({listener.fileno()}, 1, os.getpid()), "
              f"pass_fds=[{listener.fileno()}], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
              f"print('started', os.getpid(), flush=True)")
    parent = subprocess.run([sys.executable, "-c", script], pass_fds=[listener.fileno()],
                            capture_output=True, text=True, timeout=10)
    listener_fd = listener.fileno()
    listener.close()
    assert "started" in parent.stdout
    parent_pid = parent.stdout.split()[1]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-f", f"commlib/crash_witness_process.py {listener_fd} 1 {parent_pid}$"],
                               capture_output=True, text=True).stdout.strip()
        if not found:
            return
        time.sleep(0.2)
    pytest.fail(f"the orphaned witness is still running: pids {found}")


def test_answers_other_hosts_where_its_ranks_are_even_after_they_died():
    """The board protocol: ranks hand the witness their progress board; askers get each rank's
    slot and process state over TCP (what a rank on another host reads after a timeout)."""
    import mmap
    import tempfile

    from commlib.progress_board import ProgressBoard
    from commlib.remote_progress import ask_hosts

    witness = Witness(2)
    connections, ports = [], []
    for rank in range(2):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(witness.address)
        connection.sendall(f"hello {rank} {1000 + rank} testhost\n".encode())
        connection.settimeout(10)
        reply = connection.recv(16).split()
        assert reply[0] == b"ok" and int(reply[1]) > 0
        ports.append(int(reply[1]))
        connections.append(connection)
    assert ports[0] == ports[1]
    with tempfile.TemporaryFile() as board_file:
        board_file.truncate(16)
        board = mmap.mmap(board_file.fileno(), 16)
        board[0:8] = ProgressBoard.encode(4, "allreduce").to_bytes(8, "little", signed=True)
        board[8:16] = ProgressBoard.encode(3, "broadcast").to_bytes(8, "little", signed=True)
        for rank, connection in enumerate(connections):  # group ranks 5 and 6 sit in slots 0 and 1
            socket.send_fds(connection, [f"board k1 {5 + rank} {rank}\n".encode()], [board_file.fileno()])
        time.sleep(0.3)
        endpoint = {0: f"127.0.0.1:{ports[0]}"}
        states, failures = ask_hosts("k1", endpoint, {0: [5, 6, 7]})
        assert failures == {} and states[5] == (ProgressBoard.encode(4, "allreduce"), "alive")
        assert states[6] == (ProgressBoard.encode(3, "broadcast"), "alive") and states[7] == (-1, "unknown")
        connections[1].close()  # rank 6's process died: the witness still shows where it was
        board[0:8] = ProgressBoard.encode(5, "allreduce").to_bytes(8, "little", signed=True)
        time.sleep(0.3)
        states, _ = ask_hosts("k1", endpoint, {0: [5, 6]})
        assert states[5] == (ProgressBoard.encode(5, "allreduce"), "alive")
        assert states[6] == (ProgressBoard.encode(3, "broadcast"), "died")
        states, _ = ask_hosts("another-group", endpoint, {0: [5]})
        assert states[5] == (-1, "unknown")
        board.close()
    _say(connections[0], b"bye")
    assert "rank 1 (pid 1001 on testhost) ended without a clean exit" in witness.finish()
    _, failures = ask_hosts("k1", {0: f"127.0.0.1:{ports[0]}"}, {0: [5]})  # gone with its ranks
    assert "refused" in failures[0].lower(), failures
