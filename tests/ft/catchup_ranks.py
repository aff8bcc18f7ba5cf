"""What the ranks of a :class:`tests.support.socket_world.SocketWorld` run for the catch-up and
link-probe tests: :func:`commlib.ft.catchup.catch_up` and :func:`commlib.ft.links.probe_links`
over a group on the rank's socket transport."""

from __future__ import annotations

import hashlib

import numpy as np

from commlib.ft import catchup
from tests.support.socket_world import process_group


def state_of(rank: int, steps: int, nbytes: int) -> np.ndarray:
    """A state that differs by rank and by step count, so a wrong source or a stale state shows."""
    return np.random.default_rng(1000 * steps + rank).integers(0, 256, nbytes, dtype=np.uint8)


def catch_up_case(state, steps_by_rank, nbytes, writable, wrong_digest=False):
    """Each rank holds ``state_of(rank, its steps)``; after the catch-up every rank reports the
    SHA-256 of its state, its step count, what ``load`` received (the ledger) and the CatchUp.
    ``wrong_digest``: the source announces another payload's SHA-256, as if bytes changed on the way."""
    group = process_group(state, "catchup")
    rank, steps = group.rank, steps_by_rank[group.rank]
    holder = {"state": state_of(rank, steps, nbytes), "steps": steps, "ledger": None}

    def save():
        data = holder["state"].copy()
        if wrong_digest:
            catchup._send_payload = lambda *args: (_ORIGINAL_SEND(*args), hashlib.sha256(b"other bytes").digest())[1]
        return {"steps": steps, "from": rank}, (data.data if writable else data.tobytes())

    def load(ledger, payload):
        assert isinstance(payload, memoryview)
        holder["state"], holder["steps"], holder["ledger"] = np.frombuffer(payload, np.uint8), ledger["steps"], ledger

    try:
        result = catchup.catch_up(group, steps, save, load)
    finally:
        catchup._send_payload = _ORIGINAL_SEND
    return (hashlib.sha256(holder["state"].data).hexdigest(), holder["steps"], holder["ledger"],
            (result.source, result.behind, result.nbytes))


_ORIGINAL_SEND = catchup._send_payload


def probe_case(state, probe_bytes, pair_only=False):
    """:func:`commlib.ft.links.probe_links` over the world (or over ranks 0 and 1 only): each
    rank's matrix, as a list (None on a rank outside the group)."""
    from commlib.ft.links import probe_links

    group = process_group(state, "catchup")
    if pair_only:
        group = group.new_group([0, 1])
        if group is None:
            return None
    return probe_links(group, probe_bytes).tolist()
