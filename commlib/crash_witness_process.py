"""The witness of :mod:`commlib.crash_witness`: ``python -I -S crash_witness_process.py FD N PID``.

Standard library only (it runs isolated, without site-packages). ``FD`` is a listening Unix
socket, ``N`` the number of ranks on this host, ``PID`` the rank that started it. Each rank
connects and sends lines: ``hello RANK PID HOST``, then ``bye`` at a clean exit or ``abort``
when it reports its own failure; the witness answers each connection with ``ok PORT`` once it
watches it (a rank's ``commlib.init`` waits for that, so no rank can die unwatched while the
witness is still starting).

It is also where ranks on *other* hosts learn how this host's ranks are doing (a timeout names
them: :mod:`commlib.remote_progress`). A rank sends ``board KEY GROUP_RANK SLOT`` with its
group's progress-board file descriptor attached (``SCM_RIGHTS``); the witness maps the board
read-only. On ``PORT`` (TCP, every interface) it answers ``where KEY R1,R2,...`` with one line
``R VALUE STATE`` per rank: the rank's board slot and whether its process is ``alive``, said
``bye`` or ``abort``, or ``died``; then ``end``. A group the witness does not know, or a rank
not on this host, gets ``R -1 unknown``. It answers from its own process, so it answers for a
rank that is stuck, or dead. ``unboard KEY`` (a group closed while its process goes on) drops
the rank's entry. The first connection to close without either, unless some rank said
``abort`` before, is a rank that died: one line names it on stderr (the job's), and the witness
stays silent from then on (the deaths that follow are mpiexec's cleanup). It exits when every
rank that connected has gone, or, if none is connected, when the rank that started it has gone
(after taking the connections already waiting): it holds the job's stderr open, and mpiexec may
wait for that.
"""

import mmap
import os
import select
import socket
import struct
import sys
import time

FIRST_CONNECTION_TIMEOUT_S = 300.0
QUERY_LIMIT_BYTES = 1 << 16
SLOT_BYTES = 8


class Rank:
    def __init__(self, connection: socket.socket):
        self.connection = connection
        self.pending = b""
        self.rank = "?"
        self.host = socket.gethostname()
        self.last_word = ""
        self.ended = False
        try:  # the kernel's word for who connected, in case the process dies before "hello"
            credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            self.pid = str(struct.unpack("3i", credentials)[0])
        except OSError:
            self.pid = "?"

    def take(self, data: bytes, fds, boards: "Boards") -> None:
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            words = line.decode(errors="replace").split()
            if not words:
                continue
            if words[0] == "hello" and len(words) >= 4:
                self.rank, self.pid, self.host = words[1], words[2], words[3]
            elif words[0] == "board" and len(words) >= 4:
                boards.register(words[1], words[2], words[3], fds.pop(0) if fds else None, self)
                continue
            elif words[0] == "unboard" and len(words) >= 2:
                boards.unregister(words[1], self)
                continue
            self.last_word = words[0]
        for fd in fds:  # more descriptors than board lines: not ours to keep
            os.close(fd)

    def state(self) -> str:
        if self.last_word in ("bye", "abort"):
            return self.last_word
        return "died" if self.ended else "alive"

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host})"


class Boards:
    """The progress boards of this host's ranks, by group key: where each group rank is."""

    def __init__(self):
        self.mappings = {}  # key -> mmap
        self.slots = {}     # key -> {group rank: (slot index, Rank)}

    def register(self, key: str, group_rank: str, slot: str, fd, rank: Rank) -> None:
        try:
            if fd is not None and key not in self.mappings:
                size = os.fstat(fd).st_size
                if size >= SLOT_BYTES:
                    self.mappings[key] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            self.slots.setdefault(key, {})[int(group_rank)] = (int(slot), rank)
        except (OSError, ValueError):
            pass
        finally:
            if fd is not None:
                os.close(fd)

    def unregister(self, key: str, rank: Rank) -> None:
        entries = self.slots.get(key, {})
        for group_rank in [r for r, (_, owner) in entries.items() if owner is rank]:
            del entries[group_rank]
        if not entries:
            self.slots.pop(key, None)
            mapping = self.mappings.pop(key, None)
            if mapping is not None:
                mapping.close()

    def answer(self, line: str) -> bytes:
        words = line.split()
        if len(words) != 3 or words[0] != "where":
            return b"end\n"
        key, wanted = words[1], words[2].split(",")
        mapping, entries = self.mappings.get(key), self.slots.get(key, {})
        out = []
        for text in wanted[:4096]:
            try:
                group_rank = int(text)
            except ValueError:
                continue
            entry = entries.get(group_rank)
            if entry is None or mapping is None or (entry[0] + 1) * SLOT_BYTES > len(mapping):
                out.append(f"{group_rank} -1 unknown")
                continue
            value = struct.unpack_from("=q", mapping, entry[0] * SLOT_BYTES)[0]
            out.append(f"{group_rank} {value} {entry[1].state()}")
        return ("\n".join(out + ["end"]) + "\n").encode()


def announce(rank: "Rank") -> None:
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    line = (f"commlib: crash witness: {rank.describe()} ended without a clean exit (killed by a "
            f"signal, crashed, or os._exit) at {stamp}: the first rank on {rank.host} to fail\n")
    try:
        os.write(2, line.encode())
    except OSError:
        pass


def query_listener():
    """A TCP listener on every interface of this host, for ``where`` queries; None if impossible."""
    try:
        try:
            server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        except (OSError, ValueError):  # no IPv6 on this host
            server = socket.create_server(("", 0))
        server.setblocking(False)
        return server
    except OSError:
        return None


class Query:
    def __init__(self, connection: socket.socket):
        self.connection = connection
        self.pending = b""


def serve_query(poller, queries, fd: int, boards: Boards) -> None:
    query = queries[fd]
    try:
        data = query.connection.recv(4096)
    except OSError:
        data = b""
    query.pending += data
    if data and b"\n" not in query.pending and len(query.pending) < QUERY_LIMIT_BYTES:
        return  # more to come
    if b"\n" in query.pending:
        reply = boards.answer(query.pending.split(b"\n", 1)[0].decode(errors="replace"))
        try:
            query.connection.settimeout(1.0)  # a small reply; a stalled asker must not stall us
            query.connection.sendall(reply)
        except OSError:
            pass
    poller.unregister(fd)
    query.connection.close()
    del queries[fd]


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
    server = query_listener()
    port = server.getsockname()[1] if server is not None else 0
    if server is not None:
        poller.register(server.fileno(), select.EPOLLIN)
    boards = Boards()
    ranks: dict[int, Rank] = {}  # by socket fd (a local annotation: never evaluated, no typing import)
    queries: dict[int, Query] = {}  # by socket fd
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
                    peer.send(f"ok {port}\n".encode(), socket.MSG_NOSIGNAL)  # watched from now on
                except OSError:
                    pass  # gone already: its close is the next event
                continue
            if server is not None and fd == server.fileno():
                try:
                    asker, _ = server.accept()
                except OSError:
                    continue
                asker.setblocking(False)
                queries[asker.fileno()] = Query(asker)
                poller.register(asker.fileno(), select.EPOLLIN)
                continue
            if fd in queries:
                serve_query(poller, queries, fd, boards)
                continue
            rank = ranks.get(fd)
            if rank is None:
                continue
            try:
                data, fds, _flags, _address = socket.recv_fds(rank.connection, 4096, 8)
            except OSError:
                data, fds = b"", []
            if data:
                rank.take(data, list(fds), boards)
                if rank.last_word == "abort":
                    silent = True  # that rank reported its own failure; the rest is cleanup
                continue
            for extra in fds:
                os.close(extra)
            poller.unregister(fd)
            rank.connection.close()
            rank.ended = True
            del ranks[fd]
            if rank.last_word not in ("bye", "abort") and not silent:
                announce(rank)
                silent = True


if __name__ == "__main__":
    main()
