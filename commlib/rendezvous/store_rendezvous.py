"""The rendezvous of ranks that meet through a key-value store (torchrun, spawn, Slurm without PMI).

Every key lives under the rendezvous' ``prefix``, so many rendezvous (the world, its hosts, its
sub-groups, the next restart of the job) share one store. Round ``n`` of an allgather is three
store calls per rank: ``set(prefix/agN/<rank>)``, one ``multi_get`` of every rank's key (waited
on the server: one round trip), and ``add(prefix/agN/read)``; the rank whose ``add`` makes the
count whole deletes the round's keys, so a finished round leaves nothing behind. A rank that never
arrives ends the round on the others in :class:`commlib.errors.CommTimeoutError` naming it.

:meth:`StoreRendezvous.join` is where a job first meets: it checks that every process agrees on
the world size and that no two claim one rank (what a launch with inconsistent ``RANK`` /
``WORLD_SIZE`` looks like), before any allgather could wait for a rank that will never come.

A *host* is the set of ranks reporting the same host name (:func:`socket.gethostname` unless
given). Where the launcher said how many ranks share this host and which one this is
(``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``: pass them as ``local_size``, ``local_rank``),
:meth:`host_local` checks the names against them: two nodes with one host name would otherwise be
taken for one host (and map each other's "shared" memory that is not shared).
"""

from __future__ import annotations

import pickle
import socket
from typing import Any, List, Optional, Set

from commlib.errors import CommTimeoutError, InvalidUsageError
from commlib.rendezvous.interface import Rendezvous
from commlib.rendezvous.store import Store

__all__ = ["StoreRendezvous"]


class StoreRendezvous(Rendezvous):
    """Rank ``rank`` of ``size`` meeting through ``store`` under ``prefix`` (see the module docstring).

    Construction is local; :meth:`join` (collective) is how a job's ranks should first meet.
    """

    kind = "store"

    def __init__(self, store: Store, rank: int, size: int, *, prefix: str = "commlib", timeout: float = 300.0,
                 host_name: Optional[str] = None, local_rank: Optional[int] = None,
                 local_size: Optional[int] = None):
        if not isinstance(size, int) or size < 1:
            raise InvalidUsageError(f"store rendezvous {prefix!r}: the world size (WORLD_SIZE) must be an integer "
                                    f">= 1, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise InvalidUsageError(f"store rendezvous {prefix!r}: the rank (RANK) must be in 0..{size - 1} for a "
                                    f"world of {size}, got {rank!r}")
        if not timeout > 0:
            raise InvalidUsageError(f"store rendezvous {prefix!r}: timeout must be > 0 seconds, got {timeout!r}")
        self.store = store
        self.rank, self.size = rank, size
        self.prefix = prefix.rstrip("/")
        self.timeout = float(timeout)
        self._host_name = host_name or socket.gethostname()
        self.local_rank, self.local_size = local_rank, local_size
        self._rounds = 0  # allgathers and broadcasts so far: the same count on every rank
        self._children = 0  # host_local and split rendezvous made so far
        self._leftovers: Set[str] = set()  # keys this rank set that a failed round may have left

    @classmethod
    def join(cls, store: Store, rank: int, size: int, **options) -> "StoreRendezvous":
        """Collective: meet, checking that every process passed the same ``size`` and its own ``rank``."""
        rendezvous = cls(store, rank, size, **options)
        rendezvous._check_membership()
        return rendezvous

    def _check_membership(self) -> None:
        store, where = self.store, self._where()
        key, mine = f"{self.prefix}/size", str(self.size).encode()
        # Rank 0 registers the world size and the others compare theirs with it. Had the first
        # rank to arrive registered it, a rank 0 that disagreed would raise and exit at once,
        # taking the store (it serves it) with it, and the rank that registered first would only
        # see a lost connection instead of the cause.
        if self.rank == 0:
            registered = store.compare_set(key, b"", mine)
        else:
            try:
                registered = store.get(key, self.timeout)
            except CommTimeoutError:
                raise self._missing_error("waiting for rank 0's world size", [key]) from None
        if registered != mine:
            raise InvalidUsageError(f"rank {self.rank}: {where}: this process has world size (WORLD_SIZE) "
                                    f"{self.size}, but {'another rank' if self.rank == 0 else 'rank 0'} joined with "
                                    f"{registered.decode(errors='replace')}; every rank must be started with the same "
                                    f"WORLD_SIZE")
        if store.add(f"{self.prefix}/rank{self.rank}", 1) > 1:
            raise InvalidUsageError(f"rank {self.rank}: {where}: another process already joined as rank {self.rank}; "
                                    f"each process needs its own RANK (or a stale process of an earlier run is "
                                    f"still here: use a fresh store or prefix per run)")
        self.allgather(None)  # returns once every rank joined, or names the ones that did not

    def _where(self) -> str:
        return (f"store rendezvous {self.prefix!r} ({self.size} rank{'s' if self.size > 1 else ''}, store "
                f"{self.store.describe()})")

    # -- the contract ------------------------------------------------------------------------
    def allgather(self, obj: Any) -> List[Any]:
        if self.size == 1:
            return [obj]
        number = self._next_round()
        base = f"{self.prefix}/ag{number}"
        mine = f"{base}/{self.rank}"
        keys = [f"{base}/{rank}" for rank in range(self.size)]
        self.store.set(mine, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        self._leftovers.add(mine)
        try:
            values = self.store.multi_get(keys, self.timeout)
        except CommTimeoutError:
            raise self._missing_error(f"allgather #{number}", keys) from None
        self._finish_round(base, keys, self.size)
        self._leftovers.discard(mine)
        return [pickle.loads(value) for value in values]

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        if not 0 <= root < self.size:
            raise InvalidUsageError(f"rank {self.rank}: {self._where()}: broadcast root {root} is not a rank")
        if self.size == 1:
            return obj
        number = self._next_round()
        key = f"{self.prefix}/bc{number}"
        if self.rank == root:
            self.store.set(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))  # the readers delete it
            return obj
        try:
            value = self.store.get(key, self.timeout)
        except CommTimeoutError:
            raise self._missing_error(f"broadcast #{number} from rank {root}", [""] * root + [key]) from None
        self._finish_round(f"{self.prefix}/bc{number}", [key], self.size - 1)
        return pickle.loads(value)

    def host_name(self) -> str:
        return self._host_name

    def host_local(self) -> "StoreRendezvous":
        names = self.allgather(self._host_name)
        order = list(dict.fromkeys(names))  # hosts in order of their lowest rank
        members = [rank for rank, name in enumerate(names) if name == self._host_name]
        position = members.index(self.rank)
        if self.local_size is not None and self.local_size != len(members):
            raise InvalidUsageError(f"rank {self.rank}: {self._where()}: the launcher says {self.local_size} ranks "
                                    f"share this host (LOCAL_WORLD_SIZE), but {len(members)} report the host name "
                                    f"{self._host_name!r} (ranks {members}); do two hosts share one name?")
        if self.local_rank is not None and self.local_rank != position:
            raise InvalidUsageError(f"rank {self.rank}: {self._where()}: the launcher says this is local rank "
                                    f"{self.local_rank} (LOCAL_RANK), but it is number {position} of the ranks "
                                    f"{members} on host {self._host_name!r}")
        number = self._next_child()
        return StoreRendezvous(self.store, position, len(members), timeout=self.timeout, host_name=self._host_name,
                               prefix=f"{self.prefix}/c{number}host{order.index(self._host_name)}")

    def split(self, member: bool, key: int) -> Optional["StoreRendezvous"]:
        entries = self.allgather((bool(member), int(key)))
        number = self._next_child()
        if not member:
            return None
        members = sorted((rank for rank, (inside, _) in enumerate(entries) if inside),
                         key=lambda rank: (entries[rank][1], rank))
        return StoreRendezvous(self.store, members.index(self.rank), len(members), timeout=self.timeout,
                               host_name=self._host_name, prefix=f"{self.prefix}/c{number}split")

    def reach_address(self) -> str:
        """This host's address on the interface that reaches the store, where the store can tell
        (a TCP store: its connection's local address), else ""."""
        local_address = getattr(self.store, "local_address", None)
        return local_address() if callable(local_address) else ""

    def close(self) -> None:
        """Delete the keys this rank set that a failed round left behind, and its join records."""
        leftovers, self._leftovers = self._leftovers, set()
        keys = sorted(leftovers) + [f"{self.prefix}/rank{self.rank}"] + ([f"{self.prefix}/size"] if self.rank == 0
                                                                          else [])
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - the store may be gone at teardown; nothing is left to clean then
                return

    # -- rounds ------------------------------------------------------------------------------
    def _next_round(self) -> int:
        self._rounds += 1
        return self._rounds

    def _next_child(self) -> int:
        self._children += 1
        return self._children

    def _finish_round(self, base: str, keys: List[str], readers: int) -> None:
        """Count this rank's read; the last reader deletes the round's keys."""
        counter = f"{base}/read"
        if self.store.add(counter, 1) == readers:
            for key in keys + [counter]:
                self.store.delete_key(key)

    def _missing_error(self, what: str, keys: List[str]) -> CommTimeoutError:
        missing = set(self.store.missing([key for key in keys if key]))
        ranks = [rank for rank, key in enumerate(keys) if key and key in missing]
        shown = ", ".join(map(str, ranks)) if ranks else "none (they arrived as the wait ended)"
        recent = getattr(self.store, "recent_refusals", None)
        refused = recent() if callable(recent) else []
        meanwhile = f"; the store refused meanwhile: {'; '.join(refused)}" if refused else ""
        return CommTimeoutError(f"rank {self.rank}: {self._where()}: {what} timed out after {self.timeout:g} s; "
                                f"rank{'s' if len(ranks) != 1 else ''} {shown} did not arrive{meanwhile}")
