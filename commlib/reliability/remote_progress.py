"""Where are the ranks on other hosts? Asked of their hosts' crash witnesses, after a timeout.

The progress board (:mod:`commlib.reliability.progress_board`) is shared memory: a rank that times out reads
its own host's peers directly, but not those of other hosts. Each host's crash witness
(:mod:`commlib.reliability.witness_process`) maps its ranks' boards and answers ``where KEY R1,R2,...``
over TCP with each rank's board slot and whether its process is alive, exited cleanly, aborted
or died. Why the witness, rather than the alternatives weighed:

* a responder thread in every rank cannot answer for a rank that is dead, stopped, or holds
  the GIL in a long call; the witness is a process of its own that outlives the ranks it watches
  and already knows which of them died;
* MPI one-sided reads (passive target) need the target to make progress (they would hang on
  exactly the ranks we ask about), and a window must be freed collectively before finalize;
* mirroring each rank's slot to its peers would put a message on every collective's hot path.

The hot path stays one plain memory store per collective; all of this runs only on the error
path, with a bounded budget (:data:`QUERY_SECONDS`), every host asked at once. Every question
starts with the job secret's handshake (purpose "witness"): a witness answers nothing else.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from commlib.reliability.crash_witness import witness_secret
from commlib.rendezvous.handshake import AuthenticationError, authenticate
from commlib.rendezvous.secret import JobSecret

__all__ = ["RemoteState", "ask_hosts", "parse_endpoint", "QUERY_SECONDS"]

QUERY_SECONDS = 1.5


class RemoteState(NamedTuple):
    """A rank's board value (``seq << 8 | code``; -1: the witness does not know it) and process state
    (``alive``, ``bye``, ``abort``, ``died``, ``unknown``)."""

    value: int
    state: str


def parse_endpoint(endpoint: str) -> Tuple[List[str], int]:
    """``"10.0.0.1,fd00::1:4242"`` -> (``["10.0.0.1", "fd00::1"]``, 4242)."""
    addresses, _, port = endpoint.rpartition(":")
    return [a for a in addresses.split(",") if a], int(port) if port.isdigit() else 0


def _ask_one(endpoint: str, key: str, ranks: Sequence[int], deadline: float, secret: Optional[JobSecret]
             ) -> Tuple[Optional[Dict[int, RemoteState]], str]:
    addresses, port = parse_endpoint(endpoint)
    if not addresses or not port:
        return None, "no address of its crash witness is known"
    tried = []
    for address in addresses:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            tried.append(f"{address}: out of time")
            break
        try:
            with socket.create_connection((address, port), timeout=remaining) as connection:
                authenticate(connection, secret, "client", max(0.05, deadline - time.monotonic()), purpose="witness")
                connection.settimeout(max(0.05, deadline - time.monotonic()))
                connection.sendall(f"where {key} {','.join(map(str, ranks))}\n".encode())
                reply = b""
                while not reply.endswith(b"end\n"):
                    chunk = connection.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
        except AuthenticationError as error:
            tried.append(f"{address}:{port}: {error}")
            continue
        except socket.timeout:
            tried.append(f"{address}:{port} did not answer in time")
            continue
        except OSError as error:
            tried.append(f"{address}:{port}: {error.strerror or type(error).__name__}")
            continue
        states = {}
        for line in reply.decode(errors="replace").splitlines():
            words = line.split()
            if len(words) == 3 and words[0].lstrip("-").isdigit() and words[1].lstrip("-").isdigit():
                states[int(words[0])] = RemoteState(int(words[1]), words[2])
        if reply.endswith(b"end\n"):
            return states, ""
        tried.append(f"{address}:{port}: incomplete answer")
    return None, "; ".join(tried)


def ask_hosts(key: str, endpoints: Dict[int, str], ranks_by_host: Dict[int, List[int]],
              seconds: float = QUERY_SECONDS, secret: Optional[JobSecret] = None
              ) -> Tuple[Dict[int, RemoteState], Dict[int, str]]:
    """Ask every host's witness at once about its ranks; (states by rank, failure text by host).
    ``secret``: what the witnesses answer to (default: the one this rank's witness was started
    with, :func:`commlib.reliability.crash_witness.witness_secret`)."""
    secret = witness_secret() if secret is None else secret
    deadline = time.monotonic() + seconds
    states: Dict[int, RemoteState] = {}
    failures: Dict[int, str] = {}
    lock = threading.Lock()

    def ask(host: int) -> None:
        found, why = _ask_one(endpoints.get(host, ""), key, ranks_by_host[host], deadline, secret)
        with lock:
            if found is None:
                failures[host] = why
            else:
                states.update(found)

    threads = [threading.Thread(target=ask, args=(host,), daemon=True) for host in ranks_by_host]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + 0.2)
    with lock:
        for host in ranks_by_host:
            if host not in failures and not any(r in states for r in ranks_by_host[host]):
                failures[host] = f"no answer within {seconds:g} s"
        return dict(states), dict(failures)
