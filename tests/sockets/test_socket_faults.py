"""Faults over the socket transport, in real processes: a rank killed, a rank that closed, a peer that
never answers, frames that do not match. Each ends in a named error on every rank, in bounded time."""

import time

import numpy as np
import pytest

from commlib.transports.socket import SocketOptions
from commlib.transports.socket.framing import FrameCodec
from commlib.transports.socket.mesh import group_id
from tests.support.socket_world import SECRET, RankSetup, SocketWorld

RANKS = "tests.sockets.socket_ranks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size,victim,loop", [(2, 1, "allreduce_loop"), (3, 1, "allreduce_loop"),
                                             (4, 3, "allreduce_loop"), (2, 0, "group_allreduce_loop")],
                         ids=["p2", "p3", "p4", "p2-fast-path"])
def test_a_killed_rank_is_named_on_every_survivor_within_a_second(size, victim, loop):
    with SocketWorld(size) as world:
        assert all(outcome[0] == "ok" for outcome in world.started), world.started
        for rank in world.spawned:
            world.channels[rank].send((f"{RANKS}:{loop}", (90.0,)))
        time.sleep(1.0)  # the ranks are deep in their allreduces
        killed = time.monotonic()
        world.kill_rank(victim)
        outcomes = world._gather(60, world.spawned)
    survivors = [rank for rank in range(size) if rank != victim]
    late = {}
    for rank in survivors:
        kind, value = outcomes[rank][:2]
        assert kind == "ok" and value is not None, f"rank {rank}: {outcomes[rank]}"
        error_type, text, when = value
        assert error_type == "PeerExitedError", f"rank {rank}: {error_type}: {text}"
        assert f"rank {victim} (host" in text and "allreduce #" in text, text
        late[rank] = when - killed
    print(f"p={size}: rank {victim} killed; seen after " + ", ".join(f"rank {r}: {s * 1e3:.1f} ms"
                                                              for r, s in sorted(late.items())))
    # Event-driven (a closed socket wakes the poll): milliseconds; the margin is for a loaded machine.
    assert max(late.values()) < 3.0, late


@pytest.mark.timeout(300)
def test_ranks_that_finish_and_close_early_break_nothing():
    with SocketWorld(4) as world:
        assert world.run(f"{RANKS}:broadcast_then_close", 0, 5) == [None] * 4
    with SocketWorld(3) as world:
        assert world.run(f"{RANKS}:barrier_then_close") == [1, 1, 1]


@pytest.mark.timeout(300)
def test_a_rank_that_closed_its_group_is_named_by_the_next_collective():
    with SocketWorld(3) as world:
        assert world.run(f"{RANKS}:sum_of_ranks") == [[6] * 5] * 3
        world.run_outcomes(f"{RANKS}:close_transport", ranks=[2])
        outcomes = world.run_outcomes(f"{RANKS}:next_collective", 30.0, ranks=[0, 1])
    texts = {rank: outcomes[rank][1] for rank in (0, 1)}
    for rank, (error_type, text) in texts.items():
        assert error_type == "PeerExitedError" and "rank 2 (host" in text, (rank, error_type, text)
    assert any("closed the group after collective #1" in text for _, text in texts.values()), texts


@pytest.mark.timeout(300)
def test_a_timeout_names_the_peer_the_collective_the_step_and_the_bytes_and_the_peer_hears_of_it():
    with SocketWorld(2) as world:
        world.channels[1].send((f"{RANKS}:sleep", (3.0,)))
        start = time.monotonic()
        (error_type, text), = [outcome[1] for outcome in
                               world.run_outcomes(f"{RANKS}:exchange_with_timeout", 0.5, "ring step 3",
                                                  ranks=[0]) if outcome[0] == "ok"]
        assert time.monotonic() - start < 20
        world._gather(30, [1])
        (heard_type, heard), = [outcome[1] for outcome in world.run_outcomes(f"{RANKS}:next_collective", 30.0,
                                                                             ranks=[1]) if outcome[0] == "ok"]
    assert error_type == "CommTimeoutError", text
    for part in ("rank 0:", "allreduce #1, ring, ring step 3, 8 B", "timed out after 0.5 s",
                 "recv of 8 B from rank 1 (host", "0 of 8 bytes arrived"):
        assert part in text, (part, text)
    assert heard_type == "CommError" and "rank 0 (host" in heard and "aborted the group" in heard \
        and "timed out" in heard, heard


def fake_rank_world(checked=True):
    """Rank 0 spawned; rank 1 is this process (it knows the secret: a peer gone rogue)."""
    options = SocketOptions(frame_checks=checked)
    world = SocketWorld(2, spawn=[0], wait=False, setup=RankSetup(options=options))
    _, _, transport = world.join_here(1, RankSetup(options=options))
    assert world.wait_started()[0][0] == "ok", world.wait_started()
    connection = transport.engine.connections[0]
    return world, transport, connection.sock, FrameCodec(checked, SECRET.job_id, group_id("world"), 4 << 20)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "plain"])
def test_a_frame_announcing_100_gb_is_an_error_not_an_allocation(checked):
    world, transport, sock, codec = fake_rank_world(checked)
    try:
        before = world.run(f"{RANKS}:max_rss_bytes")[0]
        huge = 100 << 30
        sock.sendall(codec.data_header(1, 0, 0, 8 if checked else huge, huge) + bytes(64))
        (error_type, text), = world.run(f"{RANKS}:receive", 8)
        after = world.run(f"{RANKS}:max_rss_bytes")[0]
    finally:
        transport.free_communicator()
        world.close()
    assert error_type == "CollectiveMismatchError", text
    assert "100 GiB" in text and "8 B" in text and "rank 1 (host" in text, text
    assert after - before < 64 << 20, (before, after)


@pytest.mark.timeout(300)
def test_a_frame_of_another_collective_is_a_named_mismatch_before_any_byte_lands():
    world, transport, sock, codec = fake_rank_world(True)
    try:
        sock.sendall(codec.data_header(2, 0, 0, 8, 8) + b"\xff" * 8)
        (error_type, text), = world.run(f"{RANKS}:receive", 8)
    finally:
        transport.free_communicator()
        world.close()
    assert error_type == "CollectiveMismatchError", text
    assert "collective #2 (message 0) where this rank expects #1 (message 0)" in text, text


@pytest.mark.timeout(300)
def test_bytes_that_are_not_a_frame_are_a_named_error():
    world, transport, sock, _ = fake_rank_world(True)
    try:
        sock.sendall(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
        (error_type, text), = world.run(f"{RANKS}:receive", 8)
    finally:
        transport.free_communicator()
        world.close()
    assert error_type == "CommError" and "not a commlib frame" in text and "rank 1" in text, text
