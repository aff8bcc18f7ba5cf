"""The stores (ours over TCP, the FileStore, torch's through the adapter): one contract, every kind.

Real servers, sockets and files; several clients of one store are separate connections (or file
descriptors), as the ranks of a job would hold them.
"""

import datetime
import threading
import time

import pytest

from commlib import CommError, CommTimeoutError, InvalidUsageError
from commlib.rendezvous import FileStore, TCPStore, TCPStoreServer, TorchStore
from commlib.rendezvous.secret import secret_from_text
from tests.support.launch import free_port

SECRET = secret_from_text("the secret of the store tests", "test")
KINDS = ["tcp", "file", "torch_tcp", "torch_file"]


@pytest.fixture(params=KINDS)
def open_client(request, tmp_path):
    """``open_client()`` -> a new client of one store of the parametrized kind."""
    clients = []
    kind = request.param
    if kind == "tcp":
        server = TCPStoreServer("127.0.0.1", 0, SECRET).start()
        request.addfinalizer(server.close)

        def make():
            return TCPStore("127.0.0.1", server.port, SECRET, timeout=10)
    elif kind == "file":
        def make():
            return FileStore(str(tmp_path / "store"), timeout=10)
    else:
        dist = pytest.importorskip("torch.distributed")
        if kind == "torch_tcp":
            master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
            clients.append(master)

            def make():
                return TorchStore(dist.TCPStore("127.0.0.1", master.port, 1, False,
                                                timeout=datetime.timedelta(seconds=10)))
        else:
            def make():
                return TorchStore(dist.FileStore(str(tmp_path / "torch_store"), 1), timeout=10)

    def opened():
        client = make()
        clients.append(client)
        return client

    yield opened
    for client in clients:
        if hasattr(client, "close"):
            client.close()


def test_the_operations_mean_what_torch_means(open_client):
    store = open_client()
    store.set("a", b"1")
    store.set("s", "text")  # str values are UTF-8
    assert store.get("a") == b"1" and store.get("s") == b"text"
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2 and store.get("n") == b"2"
    assert store.compare_set("a", b"1", b"2") == b"2" and store.get("a") == b"2"
    assert store.compare_set("a", b"1", b"3") == b"2"  # not the expected value: unchanged, current returned
    assert store.compare_set("fresh", b"", b"v") == b"v" and store.get("fresh") == b"v"
    assert store.compare_set("absent", b"x", b"y") == b"x" and not store.check(["absent"])
    assert store.check(["a", "n"]) and not store.check(["a", "nothing"])
    assert store.missing(["a", "nothing"]) == ["nothing"]
    assert store.multi_get(["a", "n", "s"]) == [b"2", b"2", b"text"]
    keys = store.num_keys()
    assert store.delete_key("a") is True and store.delete_key("a") is False
    assert store.num_keys() == keys - 1
    store.wait(["n", "s"], timeout=1)
    store.set("big", bytes(range(256)) * 4096)
    assert store.get("big") == bytes(range(256)) * 4096


def test_a_blocking_get_returns_when_another_client_sets_the_key(open_client):
    waiter, setter = open_client(), open_client()
    threading.Timer(0.2, lambda: setter.set("late", b"here")).start()
    start = time.monotonic()
    assert waiter.get("late", timeout=10) == b"here"
    assert time.monotonic() - start < 8


def test_a_timeout_names_the_missing_keys_and_the_client_stays_usable(open_client):
    store = open_client()
    store.set("present", b"1")
    with pytest.raises(CommTimeoutError, match="'never'") as caught:
        store.multi_get(["present", "never"], timeout=0.3)
    assert "'present'" not in str(caught.value)
    with pytest.raises(CommTimeoutError, match="never"):
        store.wait(["never"], timeout=0.2)
    with pytest.raises(CommTimeoutError, match="never"):
        store.get("never", timeout=0.2)
    assert store.get("present") == b"1"


def test_concurrent_clients_add_exactly(open_client):
    clients = [open_client() for _ in range(4)]
    results = []

    def add_many(store):
        results.extend(store.add("counter", 1) for _ in range(50))

    threads = [threading.Thread(target=add_many, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == list(range(1, 201))
    assert clients[0].get("counter") == b"200"


def test_bad_keys_and_values_are_refused_before_anything_is_sent(open_client):
    store = open_client()
    with pytest.raises(InvalidUsageError, match="non-empty str"):
        store.set("", b"x")
    with pytest.raises(InvalidUsageError, match="bytes or str"):
        store.set("k", 3)
    with pytest.raises(InvalidUsageError, match=">= 0"):
        store.get("k", timeout=-1)


def test_add_to_a_key_that_is_not_an_integer_is_an_error_on_our_stores(tmp_path):
    server = TCPStoreServer("127.0.0.1", 0, SECRET).start()
    try:
        for store in (TCPStore("127.0.0.1", server.port, SECRET), FileStore(str(tmp_path / "f"))):
            store.set("word", b"hello")
            with pytest.raises(CommError, match="not an integer"):
                store.add("word", 1)
            store.close()
    finally:
        server.close()


def test_tcp_store_values_are_bounded_on_both_sides():
    server = TCPStoreServer("127.0.0.1", 0, SECRET, max_value_bytes=1 << 16).start()
    try:
        store = TCPStore("127.0.0.1", server.port, SECRET, max_value_bytes=1 << 16)
        with pytest.raises(InvalidUsageError, match="COMMLIB_STORE_MAX_VALUE_BYTES"):
            store.set("k", bytes(1 << 20))
        big = TCPStore("127.0.0.1", server.port, SECRET, max_value_bytes=1 << 22)
        with pytest.raises(CommError, match="connection is lost"):
            big.set("k", bytes(1 << 21))  # the server's bound: it closes this connection
        assert store.add("still", 1) == 1  # and serves the others
    finally:
        server.close()


def test_tcp_store_full_is_an_error_not_growth():
    server = TCPStoreServer("127.0.0.1", 0, SECRET, max_store_bytes=1 << 16).start()
    try:
        store = TCPStore("127.0.0.1", server.port, SECRET)
        store.set("a", bytes(30000))
        with pytest.raises(CommError, match="full"):
            store.set("b", bytes(40000))
        store.set("a", bytes(60000))  # replacing counts the difference
    finally:
        server.close()


def test_a_client_that_finds_no_server_says_where_it_looked():
    port = free_port()  # below the ephemeral range: no other test's outgoing connection takes it
    with pytest.raises(CommTimeoutError, match=f"127.0.0.1:{port}.*MASTER_ADDR"):
        TCPStore("127.0.0.1", port, SECRET, timeout=0.5)


def test_a_client_connects_to_a_server_started_after_it():
    port = free_port()  # below the ephemeral range: no other test's outgoing connection takes it
    servers = []
    threading.Timer(0.3, lambda: servers.append(TCPStoreServer("127.0.0.1", port, SECRET).start())).start()
    store = TCPStore("127.0.0.1", port, SECRET, timeout=10)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    store.close()
    servers[0].close()


def test_a_port_in_use_is_named():
    server = TCPStoreServer("127.0.0.1", 0, SECRET)
    try:
        with pytest.raises(InvalidUsageError, match="in use"):
            TCPStoreServer("127.0.0.1", server.port, SECRET)
    finally:
        server.close()


def test_a_store_outlives_a_waiting_client_that_went_away():
    server = TCPStoreServer("127.0.0.1", 0, SECRET).start()
    try:
        quitter = TCPStore("127.0.0.1", server.port, SECRET)
        outcome = []

        def wait_for_k():
            try:
                quitter.get("k", 30)
            except CommError as error:
                outcome.append(error)

        thread = threading.Thread(target=wait_for_k, daemon=True)
        thread.start()
        time.sleep(0.2)
        quitter._sock.shutdown(2)  # the client's process dies mid-wait
        thread.join(10)
        assert outcome, "the dead client's get should fail"
        store = TCPStore("127.0.0.1", server.port, SECRET)
        store.set("k", b"v")  # wakes the dead waiter's entry: the server drops it, and goes on
        assert store.get("k") == b"v"
        deadline = time.monotonic() + 10
        while server.connections > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.connections == 1
    finally:
        server.close()


def test_file_store_is_private_to_its_user(tmp_path):
    import os
    import stat

    FileStore(str(tmp_path / "secretive")).set("k", b"v")
    assert stat.S_IMODE(os.stat(tmp_path / "secretive").st_mode) == 0o600


def test_file_store_rejects_a_file_that_is_not_its_log(tmp_path):
    path = tmp_path / "garbage"
    path.write_bytes(b"\x09" * 100)
    with pytest.raises(CommError, match=r"malformed|cut short"):
        FileStore(str(path)).get("k", timeout=0)


def test_the_standalone_server_serves_with_the_secret_of_its_environment():
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "COMMLIB_JOB_SECRET": "the secret of the store tests", "MPI4PY_RC_INITIALIZE": "0"}
    server = subprocess.Popen([sys.executable, "-m", "commlib.rendezvous", "--port", "0"],
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stderr.readline()
        found = re.search(r"serving tcp://127\.0\.0\.1:(\d+)", line)
        assert found, line
        store = TCPStore("127.0.0.1", int(found.group(1)), SECRET, timeout=10)
        store.set("k", b"v")
        assert store.get("k") == b"v"
        store.close()
    finally:
        server.terminate()
        server.wait(30)
    refused = subprocess.run([sys.executable, "-m", "commlib.rendezvous", "--port", "0"],
                             capture_output=True, text=True, env={**env, "COMMLIB_JOB_SECRET": ""}, timeout=60)
    assert refused.returncode != 0 and "no job secret" in refused.stderr
