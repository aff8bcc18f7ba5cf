"""P real processes that meet through our TCP store and talk over the socket transport.

``SocketWorld(size)`` starts a store server in the calling (pytest) process and spawns ``size``
ranks; each joins a :class:`commlib.rendezvous.StoreRendezvous`, builds a
:class:`commlib.transports.socket.SocketTransport`, then serves commands:
``world.run("module:function", *args)`` calls ``function(rank_state, *args)`` on every rank and
returns their results in rank order (``rank_state.transport``, ``.rendezvous``, ``.store``,
``.refusals``: the ``commlib.auth`` log lines of the rank). A rank that raises makes ``run``
raise on the caller with every rank's outcome; a rank that does not answer within ``timeout``
is a failure too (the world is killed), never a hang. One world serves many commands, so a
test module pays the processes' start once per world size.

``per_rank`` options let single ranks differ (another secret, a delay before joining), for
the tests of what must fail.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing
import os
import signal
import time
import traceback
from typing import Any, Dict, List, Optional

from commlib.rendezvous import Rendezvous, TCPStoreServer
from commlib.rendezvous.secret import JobSecret, secret_from_text

__all__ = ["SocketWorld", "RankSetup", "SECRET", "RankFailed", "process_group"]

SECRET = secret_from_text("the socket world's job secret", "tests")

# Ranks are forked from a server process that imported commlib once (a spawned rank would import
# it, numpy and the rank functions' modules anew: about a second of CPU each, tens of ranks a
# run). The server is single-threaded, so its forks are safe; it starts with the first world,
# with the environment of that moment (MPI4PY_RC_INITIALIZE=0 included, see SocketWorld).
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["tests.support.socket_world", "commlib.group.process_group",
                                 "commlib.transports.socket", "commlib.rendezvous", "tests.sockets.socket_ranks"])


@dataclasses.dataclass
class RankSetup:
    secret: Optional[JobSecret] = SECRET
    options: Any = None  # SocketOptions; default ones when None
    timeout: float = 60.0
    join_after: Optional[str] = None  # a store key this rank waits for before building its transport
    # a store key this rank waits for once the ranks swapped their addresses, before it connects
    # (the others' listeners are open meanwhile: what the stranger tests knock at)
    connect_after: Optional[str] = None
    env: Optional[Dict[str, str]] = None


class RankFailed(AssertionError):
    def __init__(self, outcomes):
        self.outcomes = outcomes
        super().__init__("\n".join(f"rank {rank}: {outcome[0]}: {outcome[1]}" for rank, outcome in enumerate(outcomes)
                                   if outcome[0] != "ok"))


class _ConnectLater(Rendezvous):
    """A rendezvous whose second allgather (the mesh's address exchange) returns only once ``key``
    is in the store: the rank then connects late, as a slow rank would."""

    def __init__(self, inner, store, key):
        self.inner, self.store, self.key = inner, store, key
        self.rank, self.size, self.kind = inner.rank, inner.size, inner.kind
        self.calls = 0

    def allgather(self, obj):
        result = self.inner.allgather(obj)
        self.calls += 1
        if self.calls == 2:
            self.store.get(self.key, 120)
        return result

    def host_local(self):
        return self.inner.host_local()

    def host_name(self):
        return self.inner.host_name()

    def split(self, member, key):
        return self.inner.split(member, key)

    def reach_address(self):
        return self.inner.reach_address()


class RankState:
    def __init__(self, rank, size, store, rendezvous, transport, refusals):
        self.rank, self.size = rank, size
        self.store, self.rendezvous, self.transport = store, rendezvous, transport
        self.refusals = refusals
        self.group = None  # process_group's, once a test asks for one


def process_group(state: RankState, name: str):
    """The rank's :class:`commlib.group.process_group.ProcessGroup` over its socket transport,
    made at the first call (later calls give the same group): sockets only, no crash witness,
    a 60 s timeout."""
    group = state.group
    if group is None:
        from commlib.config import load_config
        from commlib.group.process_group import ProcessGroup

        config = dataclasses.replace(load_config(), shm=False, crash_witness=False)
        group = state.group = ProcessGroup(transport=state.transport, timeout=60, config=config, name=name)
    return group


class _Collect(logging.Handler):
    def __init__(self, lines):
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record):
        self.lines.append(record.getMessage())


def _serve(rank: int, size: int, port: int, setup: RankSetup, channel) -> None:
    if setup.env:
        os.environ.update(setup.env)
    from commlib.rendezvous import StoreRendezvous, TCPStore
    from commlib.transports.socket import SocketOptions, SocketTransport

    refusals: List[str] = []
    logging.getLogger("commlib.auth").addHandler(_Collect(refusals))
    try:
        store = TCPStore("127.0.0.1", port, SECRET, timeout=setup.timeout)
        rendezvous = StoreRendezvous.join(store, rank, size, prefix="world", timeout=setup.timeout)
        if setup.join_after:
            store.get(setup.join_after, setup.timeout)
        meeting = _ConnectLater(rendezvous, store, setup.connect_after) if setup.connect_after else rendezvous
        transport = SocketTransport(meeting, setup.secret, options=setup.options or SocketOptions(),
                                    timeout=setup.timeout)
        state = RankState(rank, size, store, rendezvous, transport, refusals)
        channel.send(("ok", None))
    except Exception as error:  # noqa: BLE001 - reported to the test
        channel.send(("error", f"{type(error).__name__}: {error}", traceback.format_exc(), list(refusals)))
        state = RankState(rank, size, None, None, None, refusals)
    while True:
        command = channel.recv()
        if command is None:
            break
        target, args = command
        module, function = target.split(":")
        try:
            channel.send(("ok", getattr(importlib.import_module(module), function)(state, *args)))
        except Exception as error:  # noqa: BLE001 - reported to the test
            channel.send(("error", f"{type(error).__name__}: {error}", traceback.format_exc(), list(refusals)))
    if state.transport is not None:
        state.transport.free_communicator()


class SocketWorld:
    def __init__(self, size: int, *, per_rank: Optional[Dict[int, RankSetup]] = None, setup: Optional[RankSetup] = None,
                 start_timeout: float = 120.0, spawn: Optional[List[int]] = None, wait: bool = True):
        """``spawn``: the ranks to start (default all; the caller plays the others, see
        :meth:`join_here`); ``wait``: return once every spawned rank built its transport."""
        self.size = size
        self.server = TCPStoreServer("127.0.0.1", 0, SECRET).start()
        context = _CONTEXT
        self.spawned = list(range(size)) if spawn is None else list(spawn)
        self.channels: List[Any] = [None] * size
        self.processes: List[Any] = [None] * size
        self.start_timeout = start_timeout
        self._started: Optional[List[tuple]] = None
        # The ranks run as under torchrun: no MPI. Importing commlib imports mpi4py, which would
        # initialize MPI (a singleton MPICH listens on ports of its own); the children inherit this.
        saved = os.environ.get("MPI4PY_RC_INITIALIZE")
        os.environ["MPI4PY_RC_INITIALIZE"] = "0"
        try:
            for rank in self.spawned:
                mine, theirs = context.Pipe()
                rank_setup = (per_rank or {}).get(rank, setup or RankSetup())
                process = context.Process(target=_serve, args=(rank, size, self.server.port, rank_setup, theirs),
                                          name=f"socket-rank-{rank}", daemon=True)
                process.start()
                theirs.close()
                self.channels[rank] = mine
                self.processes[rank] = process
        finally:
            if saved is None:
                del os.environ["MPI4PY_RC_INITIALIZE"]
            else:
                os.environ["MPI4PY_RC_INITIALIZE"] = saved
        if wait:
            self.wait_started()

    def wait_started(self) -> List[tuple]:
        """Every spawned rank's start-up outcome: ("ok", None) or ("error", message, traceback, refusals)."""
        if self._started is None:
            self._started = self._gather(self.start_timeout, self.spawned)
        return self._started

    @property
    def started(self) -> List[tuple]:
        return [outcome for rank, outcome in enumerate(self.wait_started()) if rank in self.spawned]

    def join_here(self, rank: int, setup: Optional[RankSetup] = None):
        """Rank ``rank`` in this process: its (store, rendezvous, transport), built collectively."""
        from commlib.rendezvous import StoreRendezvous, TCPStore
        from commlib.transports.socket import SocketOptions, SocketTransport

        setup = setup or RankSetup()
        store = TCPStore("127.0.0.1", self.port, SECRET, timeout=setup.timeout)
        rendezvous = StoreRendezvous.join(store, rank, self.size, prefix="world", timeout=setup.timeout)
        transport = SocketTransport(rendezvous, setup.secret, options=setup.options or SocketOptions(),
                                    timeout=setup.timeout)
        return store, rendezvous, transport

    @property
    def port(self) -> int:
        return self.server.port

    def _gather(self, timeout: float, ranks) -> List[tuple]:
        deadline = time.monotonic() + timeout
        outcomes: List[tuple] = [("missing", "no answer")] * self.size
        for rank in ranks:
            channel = self.channels[rank]
            remaining = deadline - time.monotonic()
            if channel.poll(max(remaining, 0)):
                try:
                    outcomes[rank] = channel.recv()
                except EOFError:
                    outcomes[rank] = ("died", f"exit code {self.processes[rank].exitcode}")
            elif not self.processes[rank].is_alive():
                outcomes[rank] = ("died", f"exit code {self.processes[rank].exitcode}")
            else:
                outcomes[rank] = ("hung", f"no answer within {timeout:g} s")
        return outcomes

    def run_outcomes(self, target: str, *args, timeout: float = 120.0, ranks=None) -> List[tuple]:
        """Every rank's raw outcome: ("ok", value) or ("error", message, traceback, refusals)."""
        ranks = list(self.spawned) if ranks is None else list(ranks)
        for rank in ranks:
            self.channels[rank].send((target, args))
        outcomes = self._gather(timeout, ranks)
        if any(outcome[0] == "hung" for outcome in outcomes):
            self.kill()
        return outcomes

    def run(self, target: str, *args, timeout: float = 120.0) -> List[Any]:
        outcomes = self.run_outcomes(target, *args, timeout=timeout)
        mine = [outcomes[rank] for rank in self.spawned]
        if any(outcome[0] != "ok" for outcome in mine):
            raise RankFailed(mine)
        return [outcome[1] for outcome in mine]

    def kill_rank(self, rank: int) -> None:
        os.kill(self.processes[rank].pid, signal.SIGKILL)

    def kill(self) -> None:
        for process in self.processes:
            if process is not None and process.is_alive():
                process.kill()

    def close(self) -> None:
        for rank in self.spawned:
            try:
                if self.processes[rank].is_alive():
                    self.channels[rank].send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 20
        for rank in self.spawned:
            self.processes[rank].join(max(deadline - time.monotonic(), 0.1))
        self.kill()
        for rank in self.spawned:
            self.processes[rank].join(5)
        self.server.close()

    def __enter__(self) -> "SocketWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
