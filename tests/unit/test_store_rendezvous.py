"""StoreRendezvous over a real TCP store: ranks are threads with a connection each (the rendezvous
holds no state a process could share by accident: every exchange goes through the store)."""

import threading

import pytest

from commlib import CommTimeoutError, InvalidUsageError
from commlib.rendezvous import StoreRendezvous, TCPStore, TCPStoreServer
from commlib.rendezvous.handshake import AuthenticationError
from commlib.rendezvous.secret import secret_from_text
from commlib.rendezvous.tcp_store import open_tcp_store

SECRET = secret_from_text("the secret of the rendezvous tests", "test")


@pytest.fixture(scope="module")
def server():
    server = TCPStoreServer("127.0.0.1", 0, SECRET).start()
    yield server
    server.close()


def client(server):
    return TCPStore("127.0.0.1", server.port, SECRET, timeout=30)


def on_ranks(count, body):
    """body(rank) on ``count`` threads; per-rank result or exception."""
    results = [None] * count

    def run(rank):
        try:
            results[rank] = body(rank)
        except Exception as error:  # noqa: BLE001 - the tests look at it
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allgather_broadcast_and_agreement(server, size):
    prefix = f"basic{size}"

    def body(rank):
        rendezvous = StoreRendezvous.join(client(server), rank, size, prefix=prefix, timeout=20)
        gathered = [rendezvous.allgather({"rank": rank, "square": rank * rank}) for _ in range(3)]
        root = size - 1
        told = rendezvous.broadcast(f"from {rank}" if rank == root else None, root=root)
        agree = rendezvous.all_agree(True), rendezvous.all_agree(rank != 0)
        rendezvous.close()
        return gathered, told, agree

    for rank, (gathered, told, agree) in enumerate(on_ranks(size, body)):
        assert gathered == [[{"rank": r, "square": r * r} for r in range(size)]] * 3, rank
        assert told == f"from {size - 1}"
        assert agree == (True, False)  # rank 0 disagrees
    # every round cleaned after itself, and close() took the join records
    assert not [key for key in ("size", "rank0", "ag1/0", "ag1/read") if client(server).check([f"{prefix}/{key}"])]


def test_a_missing_rank_is_named(server):
    def body(rank):
        rendezvous = StoreRendezvous(client(server), rank, 4, prefix="missing", timeout=1)
        return rendezvous.allgather(rank)

    errors = on_ranks(2, body)  # ranks 2 and 3 never come
    for error in errors:
        assert isinstance(error, CommTimeoutError) and "ranks 2, 3 did not arrive" in str(error), error


def test_a_rank_the_store_refused_is_named_with_the_refusal():
    owner = open_tcp_store("127.0.0.1", 0, SECRET, is_server=True, timeout=30)
    try:
        with pytest.raises(AuthenticationError, match="another job's secret"):
            TCPStore("127.0.0.1", owner.port, secret_from_text("another job's secret entirely", "test"), timeout=5)
        rendezvous = StoreRendezvous(owner, 0, 2, prefix="refused", timeout=1)
        with pytest.raises(CommTimeoutError) as caught:
            rendezvous.allgather(0)
        message = str(caught.value)
        assert "rank 1 did not arrive; the store refused meanwhile: 127.0.0.1:" in message, message
        assert "another job's secret" in message, message
    finally:
        owner.close()


def test_join_refuses_a_world_size_that_differs_and_a_rank_taken_twice(server):
    sizes = [3, 3, 4]

    def differing(rank):
        return StoreRendezvous.join(client(server), rank if rank < 2 else 2, sizes[rank], prefix="sizes", timeout=1)

    results = on_ranks(3, differing)
    refused = [r for r in results if isinstance(r, InvalidUsageError)]
    assert refused and all("WORLD_SIZE" in str(error) for error in refused)

    def twice(rank):
        return StoreRendezvous.join(client(server), 0 if rank < 2 else 1, 3, prefix="twice", timeout=1)

    results = on_ranks(3, twice)
    assert any(isinstance(r, InvalidUsageError) and "already joined as rank 0" in str(r) for r in results)
    with pytest.raises(InvalidUsageError, match="RANK"):
        StoreRendezvous(client(server), 5, 3)
    with pytest.raises(InvalidUsageError, match="WORLD_SIZE"):
        StoreRendezvous(client(server), 0, 0)


def test_host_local_groups_by_host_name_in_rank_order(server):
    names = ["a", "b", "a", "b", "b"]

    def body(rank):
        rendezvous = StoreRendezvous(client(server), rank, 5, prefix="hosts", timeout=20, host_name=names[rank])
        local = rendezvous.host_local()
        return local.rank, local.size, local.allgather(rank)

    assert on_ranks(5, body) == [(0, 2, [0, 2]), (0, 3, [1, 3, 4]), (1, 2, [0, 2]), (1, 3, [1, 3, 4]),
                                 (2, 3, [1, 3, 4])]


def test_host_local_checks_the_launchers_local_variables(server):
    def body(rank):
        rendezvous = StoreRendezvous(client(server), rank, 2, prefix="launcher", timeout=20, host_name="same",
                                     local_size=1, local_rank=0)
        return rendezvous.host_local()

    errors = on_ranks(2, body)
    assert all(isinstance(error, InvalidUsageError) and "LOCAL_WORLD_SIZE" in str(error) for error in errors)


def test_split_orders_by_key_and_gives_none_outside(server):
    def body(rank):
        rendezvous = StoreRendezvous(client(server), rank, 4, prefix="split", timeout=20)
        sub = rendezvous.split(rank != 1, key=-rank)
        again = rendezvous.split(True, key=0)  # a second split: its own keys
        return (None if sub is None else (sub.rank, sub.size, sub.allgather(rank))), again.allgather(rank)

    results = on_ranks(4, body)
    assert [r[0] for r in results] == [(2, 3, [3, 2, 0]), None, (1, 3, [3, 2, 0]), (0, 3, [3, 2, 0])]
    assert all(r[1] == [0, 1, 2, 3] for r in results)


def test_many_rendezvous_share_one_store(server):
    def body(rank):
        first = StoreRendezvous(client(server), rank, 2, prefix="one", timeout=20)
        second = StoreRendezvous(client(server), rank, 2, prefix="two", timeout=20)
        return first.allgather(("one", rank)), second.allgather(("two", rank))

    assert on_ranks(2, body) == [([("one", 0), ("one", 1)], [("two", 0), ("two", 1)])] * 2
