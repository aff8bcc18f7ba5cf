"""The witness of :mod:`commlib.crash_witness`: ``python -I -S crash_witness_process.py FD N PID``.

Standard library only (it runs isolated, without site-packages). ``FD`` is a listening Unix
socket, ``N`` the number of ranks on this host, ``PID`` the rank that started it. Each rank
connects and sends lines: ``hello RANK PID HOST``, then ``bye`` at a clean exit or ``abort``
when it reports its own failure; the witness answers each connection with ``ok`` once it
watches it (a rank's ``commlib.init`` waits for that, so no rank can die unwatched while the
witness is still starting). The first connection to close without either, unless some rank said
``abort`` before, is a rank that died: one line names it on stderr (the job's), and the witness
stays silent from then on (the deaths that follow are mpiexec's cleanup). It exits when every
rank that connected has gone, or, if none is connected, when the rank that started it has gone
(after taking the connections already waiting): it holds the job's stderr open, and mpiexec may
wait for that.
"""

import os
import select
import socket
import struct
import sys
import time

FIRST_CONNECTION_TIMEOUT_S = 300.0


class Rank:
    def __init__(self, connection: socket.socket):
        self.connection = connection
        self.pending = b""
        self.rank = "?"
        self.host = socket.gethostname()
        self.last_word = ""
        try:  # the kernel's word for who connected, in case the process dies before "hello"
            credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            self.pid = str(struct.unpack("3i", credentials)[0])
        except OSError:
            self.pid = "?"

    def take(self, data: bytes) -> None:
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            words = line.decode(errors="replace").split()
            if not words:
                continue
            if words[0] == "hello" and len(words) >= 4:
                self.rank, self.pid, self.host = words[1], words[2], words[3]
            self.last_word = words[0]

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host})"


def announce(rank: "Rank") -> None:
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    line = (f"commlib: crash witness: {rank.describe()} ended without a clean exit (killed by a "
            f"signal, crashed, or os._exit) at {stamp}: the first rank on {rank.host} to fail\n")
    try:
        os.write(2, line.encode())
    except OSError:
        pass


def main() -> None:
    listener = socket.socket(fileno=int(sys.argv[1]))
    expected = int(sys.argv[2])
    parent = int(sys.argv[3])
    # epoll, not select: its ready list is first-come first-served, so when the witness runs
    # late (a loaded machine) and finds the killed rank and the cleanup's victims all closed,
    # the first event is still the first death (select's fd order named the wrong rank in 2 runs
    # of 50 with SIGKILL at P=3).
    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    ranks = {}  # fd -> Rank
    accepted = 0
    silent = False
    started = time.monotonic()
    while True:
        if accepted and not ranks:
            return  # every rank that connected has gone
        if not ranks and (os.getppid() != parent or time.monotonic() - started > FIRST_CONNECTION_TIMEOUT_S):
            if not select.select([listener], [], [], 0)[0]:
                return  # nobody connected, nor waits to be accepted
        for fd, _events in poller.poll(1.0):
            if fd == listener.fileno():
                peer, _ = listener.accept()
                ranks[peer.fileno()] = Rank(peer)
                poller.register(peer.fileno(), select.EPOLLIN)
                accepted += 1
                if accepted == expected:
                    poller.unregister(listener.fileno())
                try:
                    peer.send(b"ok\n", socket.MSG_NOSIGNAL)  # watched from now on
                except OSError:
                    pass  # gone already: its close is the next event
                continue
            rank = ranks.get(fd)
            if rank is None:
                continue
            try:
                data = rank.connection.recv(4096)
            except OSError:
                data = b""
            if data:
                rank.take(data)
                if rank.last_word == "abort":
                    silent = True  # that rank reported its own failure; the rest is cleanup
                continue
            poller.unregister(fd)
            rank.connection.close()
            del ranks[fd]
            if rank.last_word not in ("bye", "abort") and not silent:
                announce(rank)
                silent = True


if __name__ == "__main__":
    main()
