"""Meeting without MPI: the launcher's variables, the store they point to, the rendezvous over it.

torch's launchers tell every process who it is and where to meet:

==========================  =================================================================
``RANK``, ``WORLD_SIZE``    this process's rank and how many there are (required)
``LOCAL_RANK``,             its rank on its host and how many share the host (optional; when
``LOCAL_WORLD_SIZE``        given, the host grouping is checked against them)
``MASTER_ADDR``,            where rank 0 is: the store's address (required for ``env://``)
``MASTER_PORT``
``TORCHELASTIC_USE_AGENT_   ``True`` under torchrun: ``MASTER_PORT`` is torchrun's own store
STORE``                     (torch's protocol), so ours takes the port after it
``TORCHELASTIC_RUN_ID``,    name this run and this restart of it: the rendezvous' keys live
``TORCHELASTIC_RESTART_     under them, so a restarted job never reads a previous attempt's
COUNT``
==========================  =================================================================

Where to meet, first that applies: a store handed in (ours, or a torch ``c10d.Store`` through
:class:`~commlib.rendezvous.torch_store.TorchStore`); an ``init_method`` URL (``tcp://HOST:PORT``,
``file:///path``, ``env://``); ``COMMLIB_STORE`` (the same URLs); the variables above (``env://``).
For ``tcp://`` and ``env://`` rank 0 runs the store's server, bound to that address only.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from typing import Mapping, Optional, Tuple

from commlib.errors import InvalidUsageError
from commlib.rendezvous.file_store import FileStore
from commlib.rendezvous.secret import JobSecret
from commlib.rendezvous.store import Store
from commlib.rendezvous.store_rendezvous import StoreRendezvous
from commlib.rendezvous.tcp_store import open_tcp_store
from commlib.rendezvous.torch_store import TorchStore

__all__ = ["LaunchEnvironment", "open_store", "meet"]


@dataclasses.dataclass(frozen=True)
class LaunchEnvironment:
    """What the launcher said (see the module docstring); None where it said nothing."""

    rank: Optional[int] = None
    world_size: Optional[int] = None
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    agent_store: bool = False
    run_id: str = ""
    restart_count: int = 0

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "LaunchEnvironment":
        environ = os.environ if environ is None else environ

        def integer(name: str, low: int = 0) -> Optional[int]:
            text = environ.get(name)
            if text is None or text == "":
                return None
            try:
                value = int(text)
            except ValueError:
                raise InvalidUsageError(f"{name}={text!r}: expected an integer") from None
            if value < low:
                raise InvalidUsageError(f"{name}={value}: expected an integer >= {low}")
            return value

        return cls(rank=integer("RANK"), world_size=integer("WORLD_SIZE", 1), local_rank=integer("LOCAL_RANK"),
                   local_world_size=integer("LOCAL_WORLD_SIZE", 1),
                   master_addr=environ.get("MASTER_ADDR") or None, master_port=integer("MASTER_PORT", 1),
                   agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                   run_id=environ.get("TORCHELASTIC_RUN_ID", ""),
                   restart_count=integer("TORCHELASTIC_RESTART_COUNT") or 0)

    def prefix(self) -> str:
        """The rendezvous' key prefix: this run and this restart of it."""
        return f"commlib/{self.run_id or 'job'}/{self.restart_count}"


def open_store(url: Optional[str], launch: LaunchEnvironment, rank: int, secret: Optional[JobSecret], *,
               timeout: float, config) -> Tuple[Store, str]:
    """``(store, where)``: the store ``url`` names (``env://`` or None: the launcher's variables)."""
    parsed = urllib.parse.urlparse(url or "env://")
    if parsed.scheme == "file":
        path = urllib.parse.unquote(parsed.path)
        if not path:
            raise InvalidUsageError(f"init_method {url!r}: a file:// URL needs a path (file:///tmp/rendezvous)")
        return FileStore(path, timeout=timeout), f"file store {path}"
    if parsed.scheme == "tcp":
        if not parsed.hostname or not parsed.port:
            raise InvalidUsageError(f"init_method {url!r}: expected tcp://HOST:PORT")
        host, port = parsed.hostname, parsed.port
    elif parsed.scheme == "env":
        missing = [name for name, value in (("MASTER_ADDR", launch.master_addr), ("MASTER_PORT", launch.master_port))
                   if value is None]
        if missing:
            raise InvalidUsageError(f"rank {rank}: {' and '.join(missing)} not set: where the job's ranks meet "
                                    f"(set them, or pass init_method='tcp://HOST:PORT' / 'file:///path', or "
                                    f"COMMLIB_STORE)")
        assert launch.master_addr is not None and launch.master_port is not None  # checked above
        # Under torchrun's agent store MASTER_PORT speaks torch's protocol, not ours.
        host, port = launch.master_addr, launch.master_port + (1 if launch.agent_store else 0)
    else:
        raise InvalidUsageError(f"init_method {url!r}: expected tcp://HOST:PORT, file:///path or env://")
    store = open_tcp_store(host, port, secret, is_server=rank == 0, timeout=timeout,
                           handshake_timeout=config.handshake_timeout, max_value_bytes=config.store_max_value_bytes)
    return store, f"tcp store at {host}:{port}"


def meet(store, rank: int, world_size: int, launch: LaunchEnvironment, *, timeout: float,
         prefix: Optional[str] = None, world: bool = True) -> StoreRendezvous:
    """Collective: the rendezvous over ``store`` (ours, or a torch store, adapted) of the world
    (its hosts are checked against ``LOCAL_WORLD_SIZE``) or of a sub-group (``world=False``)."""
    if not isinstance(store, Store):
        store = TorchStore(store, timeout=timeout)
    local = dict(local_rank=launch.local_rank, local_size=launch.local_world_size) if world else {}
    return StoreRendezvous.join(store, rank, world_size, prefix=prefix or launch.prefix(), timeout=timeout, **local)
