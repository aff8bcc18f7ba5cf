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

from commlib.reliability import crash_witness
from commlib.rendezvous.secret import secret_from_text

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")


SECRET = secret_from_text("the witness tests' job secret", "tests")
OTHER = secret_from_text("another job's secret entirely", "tests")


class Witness:
    def __init__(self, ranks: int, listen=(), handshake_timeout: float = 10.0):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.address = f"\0commlib-witness-test-{os.getpid()}-{time.monotonic_ns()}".encode()
        self.listener.bind(self.address)
        self.listener.listen(ranks)
        key_out, key_in = os.pipe()
        self.process = subprocess.Popen(
            crash_witness.witness_command(self.listener.fileno(), ranks, os.getpid(), secret_fd=key_out, listen=listen,
                                          handshake_timeout=handshake_timeout),
            pass_fds=[self.listener.fileno(), key_out], stderr=subprocess.PIPE, text=True)
        os.write(key_in, SECRET.key)
        os.close(key_in)
        os.close(key_out)
        self.listener.close()

    def rank(self, rank: int, pid: int = 0) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.address)
        connection.sendall(f"hello {rank} {pid or 1000 + rank} testhost\n".encode())
        connection.settimeout(10)
        reply = connection.recv(16)
        assert reply.startswith(b"ok ") and reply.endswith(b"\n"), "the witness answers once it watches the connection"
        self.port = int(reply.split()[1])
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


def _wait_for_state(pid: int, wanted, timeout: float = 20.0) -> None:
    """Until /proc says the process is in ``wanted(state letter, wait channel)``."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/wchan") as wchan:
            state, channel = stat.read().rsplit(")", 1)[1].split()[0], wchan.read()
        if wanted(state, channel):
            return
        assert time.monotonic() < deadline, f"the witness (pid {pid}) stayed in state {state} ({channel})"
        time.sleep(0.005)


def test_deaths_seen_late_are_still_named_in_the_order_they_happened():
    # A loaded machine: the witness gets no CPU while the killed rank and then the cleanup's
    # victims close. Stopped here on purpose, so all closes wait for it at once.
    witness = Witness(4)
    ranks = [witness.rank(r) for r in range(4)]
    # Stopped while idle: "ok" comes while the witness still reads rank 3's connection, and a
    # close that lands within that read is seen there first (as it would be in a real job). And
    # SIGSTOP lands asynchronously: the closes wait until the witness is really stopped.
    _wait_for_state(witness.process.pid, lambda state, wchan: state == "S" and "epoll" in wchan)
    os.kill(witness.process.pid, signal.SIGSTOP)
    try:
        _wait_for_state(witness.process.pid, lambda state, wchan: state == "T")
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
    script = (f"import os, subprocess; from commlib.reliability.crash_witness import witness_command; "
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
        found = subprocess.run(["pgrep", "-f", f"commlib/reliability/witness_process.py {listener_fd} 1 {parent_pid}$"],
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

    from commlib.reliability.progress_board import ProgressBoard
    from commlib.reliability.remote_progress import ask_hosts

    witness = Witness(2, listen=["127.0.0.1"])
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
        states, failures = ask_hosts("k1", endpoint, {0: [5, 6, 7]}, secret=SECRET)
        assert failures == {} and states[5] == (ProgressBoard.encode(4, "allreduce"), "alive")
        assert states[6] == (ProgressBoard.encode(3, "broadcast"), "alive") and states[7] == (-1, "unknown")
        connections[1].close()  # rank 6's process died: the witness still shows where it was
        board[0:8] = ProgressBoard.encode(5, "allreduce").to_bytes(8, "little", signed=True)
        time.sleep(0.3)
        states, _ = ask_hosts("k1", endpoint, {0: [5, 6]}, secret=SECRET)
        assert states[5] == (ProgressBoard.encode(5, "allreduce"), "alive")
        assert states[6] == (ProgressBoard.encode(3, "broadcast"), "died")
        states, _ = ask_hosts("another-group", endpoint, {0: [5]}, secret=SECRET)
        assert states[5] == (-1, "unknown")
        _, failures = ask_hosts("k1", endpoint, {0: [5]}, secret=OTHER)  # another job's ranks learn nothing
        assert "refused: another job's secret" in failures[0], failures
        board.close()
    _say(connections[0], b"bye")
    assert "rank 1 (pid 1001 on testhost) ended without a clean exit" in witness.finish()
    _, failures = ask_hosts("k1", {0: f"127.0.0.1:{ports[0]}"}, {0: [5]}, secret=SECRET)  # gone with its ranks
    assert "refused" in failures[0].lower(), failures


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _exactly(sock: socket.socket, count: int) -> bytes:
    """Up to ``count`` bytes, until the end of the stream (a reset ends it too: the witness closes
    with a stranger's unread bytes still queued)."""
    data = b""
    while len(data) < count:
        try:
            chunk = sock.recv(count - len(data))
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def test_without_other_hosts_there_is_no_query_port():
    witness = Witness(1)
    rank = witness.rank(0)
    assert witness.port == 0
    _say(rank, b"bye")
    assert witness.finish() == ""


def test_the_query_port_answers_only_the_job_and_logs_each_stranger_once():
    from commlib.reliability.remote_progress import ask_hosts
    from commlib.rendezvous.handshake import CHALLENGE_BYTES, REPLY_BYTES, ClientHandshake

    witness = Witness(1, listen=["127.0.0.1"], handshake_timeout=3.0)
    rank = witness.rank(0)
    endpoint, target = {0: f"127.0.0.1:{witness.port}"}, ("127.0.0.1", witness.port)
    states, failures = ask_hosts("k", endpoint, {0: [0]}, secret=SECRET)
    assert failures == {} and states[0] == (-1, "unknown")
    before = _rss_bytes(witness.process.pid)
    answers = []
    for _ in range(3):  # random bytes, and the old protocol's plain question: the challenge, nothing else
        for junk in (os.urandom(4096), b"where k 0\n", (100 << 30).to_bytes(8, "little") + os.urandom(64)):
            with socket.create_connection(target, timeout=10) as stranger:
                stranger.sendall(junk)
                try:
                    stranger.shutdown(socket.SHUT_WR)  # the short ones end there: a truncated handshake
                except OSError:
                    pass  # refused and reset already (the long ones)
                answers.append(_exactly(stranger, 4096))
    assert all(len(answer) in (0, CHALLENGE_BYTES, CHALLENGE_BYTES + REPLY_BYTES) and answer[:4] in (b"", b"CLHS")
               for answer in answers), answers[:2]
    assert not any(b"end" in answer or b"unknown" in answer for answer in answers)
    with socket.create_connection(target, timeout=10) as first, socket.create_connection(target, timeout=10) as second:
        genuine = ClientHandshake(SECRET, "witness").answer(_exactly(first, CHALLENGE_BYTES))
        _exactly(second, CHALLENGE_BYTES)
        second.sendall(genuine)  # a real rank's answer to another challenge: a replay
        assert _exactly(second, REPLY_BYTES)[5] == 4  # REFUSE
        first.sendall(genuine[:50])  # and a truncated one
    for secret, purpose in ((OTHER, "witness"), (SECRET, "transport")):
        with socket.create_connection(target, timeout=10) as stranger:
            client = ClientHandshake(secret, purpose)
            stranger.sendall(client.answer(_exactly(stranger, CHALLENGE_BYTES)) if purpose == "witness" else
                             ClientHandshake(secret, "witness").answer(_exactly(stranger, CHALLENGE_BYTES))[:4]
                             + b"\x01\x02\x02" + bytes(105))
            assert _exactly(stranger, REPLY_BYTES)[5] == 4
    idle = [socket.create_connection(target, timeout=10) for _ in range(300)]  # more than it keeps open
    time.sleep(0.5)
    states, failures = ask_hosts("k", endpoint, {0: [0]}, secret=SECRET)  # answered meanwhile
    assert failures == {} and states[0] == (-1, "unknown"), failures
    time.sleep(3.5)  # past the handshake timeout: what was left is closed
    ends = [_exactly(sock, 4096) for sock in idle]  # challenged (48 bytes, nothing more), then closed
    assert all(len(end) == CHALLENGE_BYTES and end[:4] == b"CLHS" for end in ends), {len(end) for end in ends}
    for sock in idle:
        sock.close()
    after = _rss_bytes(witness.process.pid)
    _say(rank, b"bye")
    stderr = witness.finish()
    lines = [line for line in stderr.splitlines() if "refused a connection" in line]  # repeats are summed up
    for needle in ("not a commlib handshake", "a wrong MAC (a forged or replayed handshake)",
                   "the connection closed during the handshake", "another job's secret",
                   "a handshake for another service", "the oldest made room", "the handshake timed out"):
        found = [line for line in lines if needle in line]
        assert len(found) == 1 and "crash witness on" in found[0] and "from 127.0.0.1:" in found[0], (needle, lines)
    assert len(lines) <= 10, lines
    assert after - before < 8 << 20, (before, after)


def test_the_witness_and_the_handshake_it_loads_need_nothing_but_the_standard_library():
    import ast
    from pathlib import Path

    root = Path(crash_witness.__file__).resolve().parents[1]
    for path in (root / "reliability" / "witness_process.py", root / "rendezvous" / "handshake_core.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__", (path.name, name)
