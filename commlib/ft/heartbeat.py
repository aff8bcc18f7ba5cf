"""A replica's heartbeat: a thread that rewrites its record in the coordinator's store.

It has a store connection of its own (the main thread's may be blocked in a long ``get``), and
on it an ephemeral key (``live/<id>``): when the process dies, the kernel closes the connection
and the store deletes the key, which the coordinator sees on its next tick.
When the connection breaks (the coordinator died), it reconnects until a coordinator answers
again and registers anew: a restarted coordinator starts with an empty store and learns the
replicas only from these registrations.

With ``beats=False`` it only watches (the other ranks of a replica group of several ranks: their
leader beats for the replica, and they read the epoch's ``closed`` key as it does, to abort their
own cross-replica groups when the coordinator lost a member).
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Callable, Optional, Tuple

from commlib.errors import CommError, CommTimeoutError
from commlib.ft import keys
from commlib.rendezvous.tcp_store import TCPStore

__all__ = ["HeartbeatThread"]


class HeartbeatThread:
    """Every ``interval`` seconds, write ``record()`` (a :class:`keys.Heartbeat` minus its beat)
    as ``replica``'s heartbeat through a store that ``connect()`` opens."""

    def __init__(self, replica: str, connect: Callable[[], TCPStore], state: Callable[[], tuple],
                 interval: float = 0.1, beats: bool = True):
        self.replica = replica
        self.beats = beats
        self.connect = connect
        self.state = state
        self.interval = float(interval)
        self.beat = 0
        self.reconnects = 0
        self.last_error: Optional[BaseException] = None
        self._watch: Optional[str] = None
        self._watched: Tuple[Optional[str], str] = (None, "")
        # Called on this thread as on_change(key, value) when the watched key gets a new value.
        self.on_change: Optional[Callable[[str, str], None]] = None
        self._store: Optional[TCPStore] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"commlib-ft-{'heartbeat' if beats else 'watch'}-{replica}")

    def start(self) -> "HeartbeatThread":
        self._thread.start()
        return self

    def record(self) -> keys.Heartbeat:
        state, epoch, step = self.state()
        return keys.Heartbeat(self.beat, state, epoch, step, socket.gethostname(), os.getpid())

    def _register(self, store) -> None:
        store.set(keys.heartbeat(self.replica), self.record().encode())
        store.set_ephemeral(keys.live(self.replica), str(os.getpid()))
        index = store.add(keys.SLOTS, 1) - 1
        store.set(keys.slot(index), self.replica)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                store = self._store
                if store is None:
                    store = self._store = self.connect()
                    if self.beats:
                        self._register(store)
                if self.beats:
                    self.beat += 1
                    store.set(keys.heartbeat(self.replica), self.record().encode())
                self._read_watch()
            except CommError as error:
                self._drop()
                self.reconnects += 1
                self.last_error = error
            self._stop.wait(self.interval)
        self._drop()

    def watch(self, key: str) -> None:
        """Read ``key`` with every beat from now on (the current epoch's ``closed``), so that the
        training thread learns of a close without a round trip of its own."""
        self._watch = key
        self._watched = (key, "")

    def watched(self, key: str) -> str:
        """The value of the watched ``key`` as last read ("" while it does not exist, or when
        another key is watched now)."""
        watched_key, value = self._watched
        return value if watched_key == key else ""

    def _read_watch(self) -> None:
        key, store = self._watch, self._store
        if key is None or store is None:
            return
        try:
            value = store.get(key, 0).decode()
        except CommTimeoutError:
            value = ""
        before_key, before = self._watched
        self._watched = (key, value)
        if value and (before_key != key or value != before) and self.on_change is not None:
            self.on_change(key, value)

    def _drop(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except OSError:
                pass

    def stop(self, final_state: Optional[str] = None) -> None:
        """Stop beating; with ``final_state`` (``keys.LEFT``), say so once more first."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if final_state is not None and self.beats:
            try:
                store = self.connect()
                _, epoch, step = self.state()
                store.set(keys.heartbeat(self.replica),
                          keys.Heartbeat(self.beat + 1, final_state, epoch, step).encode())
                store.close()
            except CommError:
                pass
