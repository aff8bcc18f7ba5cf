"""The witness of :mod:`commlib.reliability.crash_witness`: ``python -I -S witness_process.py FD N PID
[--listen ADDR,... --secret-fd K --handshake PATH --handshake-timeout S]``.

Standard library only (it runs isolated, without site-packages; the handshake it needs is loaded
from ``PATH``, :mod:`commlib.rendezvous.handshake_core`, which imports nothing else). ``FD`` is a
listening Unix socket, ``N`` the number of ranks on this host, ``PID`` the rank that started it.
Each rank
connects and sends lines: ``hello RANK PID HOST``, then ``bye`` at a clean exit or ``abort``
when it reports its own failure; the witness answers each connection with ``ok PORT`` once it
has read its hello and watches it (a rank's ``commlib.init`` waits for that, so no rank can die
unwatched, or unnamed, while the witness is still starting).

It is also where ranks on *other* hosts learn how this host's ranks are doing (a timeout names
them: :mod:`commlib.reliability.remote_progress`). A rank sends ``board KEY GROUP_RANK SLOT`` with its
group's progress-board file descriptor attached (``SCM_RIGHTS``); the witness maps the board
read-only. On ``PORT`` (TCP, only on the ``--listen`` addresses: those that reach the job's other
hosts; no port at all without them) every connection first proves the job secret (the handshake,
purpose "witness", its key read from descriptor ``K``) before a byte of it is read as a query or
answered; strangers are refused and logged on stderr once per host and kind of reason, half-open
connections are bounded (the oldest makes room) and closed after ``S`` seconds. An authenticated
asker sends ``where KEY R1,R2,...`` (one line, at most 64 KiB) and gets one line
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

import argparse
import importlib.util
import logging
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
        self.greeted = False  # its hello has been read: answered "ok", once
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
                self.greeted = True
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


class QueryPort:
    """The TCP port where ranks of other hosts ask (see the module docstring)."""

    MAX_OPEN = 256

    def __init__(self, poller, addresses, core, key: bytes, handshake_timeout: float):
        self.poller, self.core, self.handshake_timeout = poller, core, handshake_timeout
        self.secret = core.Key(key)
        self.listeners = {}  # fd -> socket
        port = 0
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            try:
                listener = socket.create_server((address, port), family=family, backlog=128)
            except OSError:
                continue  # that address is gone, or its port taken: the others serve
            listener.setblocking(False)
            port = listener.getsockname()[1]
            self.listeners[listener.fileno()] = listener
            poller.register(listener.fileno(), select.EPOLLIN)
        self.port = port
        self.queries: "dict[int, Query]" = {}  # by socket fd, oldest first
        log = logging.getLogger("commlib.auth.witness")
        log.propagate = False
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        self.refusals = core.RefusalLog(f"commlib: crash witness on {socket.gethostname()} (query port {port})",
                                        logger=log)

    def owns(self, fd: int) -> bool:
        return fd in self.listeners or fd in self.queries

    def next_deadline(self) -> float:
        return min((query.deadline for query in self.queries.values()), default=float("inf"))

    def serve(self, fd: int, boards: "Boards") -> None:
        if fd in self.listeners:
            self.accept(self.listeners[fd])
            return
        query = self.queries[fd]
        if query.connection.state == "hello":
            state = query.connection.step()
            if state == "refused":
                self.drop(query, query.connection.refusal)
                return
            if state == "hello":
                self.poller.modify(fd, select.EPOLLOUT if query.connection.wants_write else select.EPOLLIN)
                return
            self.poller.modify(fd, select.EPOLLIN)  # authenticated: its query comes next
        if query.reply is None:
            try:
                data = query.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            query.pending += data
            if b"\n" not in query.pending:
                if not data or len(query.pending) >= QUERY_LIMIT_BYTES:
                    self.drop(query, None)  # closed early, or a line longer than any query
                return
            query.reply = bytearray(boards.answer(query.pending.split(b"\n", 1)[0].decode(errors="replace")))
            self.poller.modify(fd, select.EPOLLOUT)
        try:
            sent = query.sock.send(query.reply)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(query.reply)
        del query.reply[:sent]
        if not query.reply:
            self.drop(query, None)

    def accept(self, listener) -> None:
        for _ in range(16):
            try:
                sock, address = listener.accept()
            except OSError:  # nothing waits, or out of descriptors: the next round retries
                return
            source = f"[{address[0]}]:{address[1]}" if ":" in address[0] else f"{address[0]}:{address[1]}"
            if len(self.queries) >= self.MAX_OPEN:  # an asker authenticates in milliseconds: the oldest is idle
                self.drop(next(iter(self.queries.values())),
                          f"{self.MAX_OPEN} connections were open at once; the oldest made room")
            sock.setblocking(False)
            handshake = self.core.ServerHandshake(self.secret, "witness")
            query = Query(sock, self.core.ServerConnection(sock, source, handshake,
                                                           time.monotonic() + self.handshake_timeout))
            self.queries[sock.fileno()] = query
            self.poller.register(sock.fileno(), select.EPOLLOUT)

    def expire(self, now: float) -> None:
        for query in [query for query in self.queries.values() if query.deadline <= now]:
            authenticated = query.connection.state == "open"
            self.drop(query, None if authenticated else f"the handshake timed out after {self.handshake_timeout:g} s")

    def drop(self, query: "Query", why) -> None:
        if why is not None:
            self.refusals.refuse(query.connection.source, why)
        fd = query.sock.fileno()
        self.queries.pop(fd, None)
        try:
            self.poller.unregister(fd)
        except (OSError, ValueError):
            pass
        query.sock.close()


class Query:
    def __init__(self, sock: socket.socket, connection):
        self.sock, self.connection = sock, connection
        self.deadline = connection.deadline
        self.pending = b""
        self.reply: "bytearray | None" = None


def load_handshake(path: str):
    """:mod:`commlib.rendezvous.handshake_core`, from its file (this process cannot import commlib)."""
    spec = importlib.util.spec_from_file_location("commlib_handshake_core", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the handshake from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_key(fd: int) -> bytes:
    key = b""
    while len(key) < 32:
        chunk = os.read(fd, 32 - len(key))
        if not chunk:
            break
        key += chunk
    os.close(fd)
    return key


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog="witness_process.py")
    parser.add_argument("fd", type=int)
    parser.add_argument("ranks", type=int)
    parser.add_argument("parent", type=int)
    parser.add_argument("--listen", default="")
    parser.add_argument("--secret-fd", type=int, default=-1)
    parser.add_argument("--handshake", default="")
    parser.add_argument("--handshake-timeout", type=float, default=10.0)
    return parser.parse_args(argv)


def main() -> None:
    arguments = parse_arguments(sys.argv[1:])
    listener = socket.socket(fileno=arguments.fd)
    expected, parent = arguments.ranks, arguments.parent
    # epoll, not select: its ready list is first-come first-served, so when the witness runs
    # late (a loaded machine) and finds the killed rank and the cleanup's victims all closed,
    # the first event is still the first death (select's fd order named the wrong rank in 2 runs
    # of 50 with SIGKILL at P=3). Rank sockets are edge-triggered and drained to EAGAIN at each
    # event: level-triggered, an fd the witness just read goes back to the ready list's tail as it
    # is returned, ahead of deaths that come while the witness has not yet polled again, and its
    # own later close was then named first (1 CI run: rank 3 named where rank 2 closed first).
    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    listener_fd = listener.fileno()
    key = read_key(arguments.secret_fd) if arguments.secret_fd >= 0 else b""
    addresses = [address for address in arguments.listen.split(",") if address]
    server = None
    if addresses and len(key) == 32 and arguments.handshake:
        server = QueryPort(poller, addresses, load_handshake(arguments.handshake), key, arguments.handshake_timeout)
    port = server.port if server is not None else 0
    boards = Boards()
    ranks: dict[int, Rank] = {}  # by socket fd (a local annotation: never evaluated, no typing import)
    accepted = 0
    silent = False
    started = time.monotonic()
    while True:
        if accepted and not ranks:
            return  # every rank that connected has gone
        if not ranks and (os.getppid() != parent or time.monotonic() - started > FIRST_CONNECTION_TIMEOUT_S):
            if listener.fileno() < 0 or not select.select([listener], [], [], 0)[0]:
                return  # nobody connected, nor waits to be accepted
        wait = 1.0
        if server is not None:
            now = time.monotonic()
            server.expire(now)
            wait = max(0.0, min(wait, server.next_deadline() - now))
        for fd, _events in poller.poll(wait):
            if fd == listener_fd and listener.fileno() >= 0:
                peer, _ = listener.accept()
                peer.setblocking(False)
                ranks[peer.fileno()] = Rank(peer)
                # Registering checks readiness too: a hello already sent is this fd's first event.
                poller.register(peer.fileno(), select.EPOLLIN | select.EPOLLET)
                accepted += 1
                if accepted == expected:  # every rank of the host is here: nobody else may connect
                    poller.unregister(listener_fd)
                    listener.close()
                continue
            rank = ranks.get(fd)
            if rank is None and server is not None and server.owns(fd):
                server.serve(fd, boards)
                continue
            if rank is None:
                continue
            ended = drain(rank, boards, port)
            if rank.last_word == "abort":
                silent = True  # that rank reported its own failure; the rest is cleanup
            if not ended:
                continue
            poller.unregister(fd)
            rank.connection.close()
            rank.ended = True
            del ranks[fd]
            if rank.last_word not in ("bye", "abort") and not silent:
                announce(rank)
                silent = True


def drain(rank: Rank, boards: Boards, port: int) -> bool:
    """Read all a rank has sent (edge-triggered: no second event for what is left); True at its
    end of stream (its close, or its death). Answers ``ok`` as soon as its hello is read."""
    while True:
        try:
            data, fds, _flags, _address = socket.recv_fds(rank.connection, 4096, 8)
        except BlockingIOError:
            return False
        except OSError:
            return True
        if not data:
            for extra in fds:
                os.close(extra)
            return True
        greeted = rank.greeted
        rank.take(data, list(fds), boards)
        if rank.greeted and not greeted:
            try:
                rank.connection.send(f"ok {port}\n".encode(), socket.MSG_NOSIGNAL)  # watched from now on
            except OSError:
                pass  # gone already: the next read says so


if __name__ == "__main__":
    main()
