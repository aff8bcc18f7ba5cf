"""The job secret and the handshake: where the secret comes from, what the handshake refuses, a fuzz
of its parsers and of the store's frame parser (hypothesis)."""

import logging
import os
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commlib import InvalidUsageError
from commlib.config import Config
from commlib.rendezvous.handshake import (CHALLENGE_BYTES, REPLY_BYTES, RESPONSE_BYTES, AuthenticationError,
                                          ClientHandshake, RefusalLog, ServerHandshake, authenticate)
from commlib.rendezvous.secret import configured_secret, generate_secret, read_secret_file, secret_from_text
from commlib.rendezvous.store_protocol import FrameReader, ProtocolError, decode, encode

SECRET = secret_from_text("sixteen chars or more", "test")
OTHER = secret_from_text("another job's secret text", "test")


# -- the secret --------------------------------------------------------------------------------
def test_the_secret_comes_from_the_environment_or_a_private_file(tmp_path):
    assert configured_secret(Config()) is None
    from_env = configured_secret(Config.from_env({"COMMLIB_JOB_SECRET": "sixteen chars or more"}))
    assert from_env.key == SECRET.key and from_env.job_id == SECRET.job_id
    path = tmp_path / "secret"
    path.write_text("sixteen chars or more\n")
    os.chmod(path, 0o600)
    assert read_secret_file(str(path)).key == SECRET.key
    assert configured_secret(Config.from_env({"COMMLIB_JOB_SECRET_FILE": str(path)})).key == SECRET.key
    assert "sixteen" not in repr(Config.from_env({"COMMLIB_JOB_SECRET": "sixteen chars or more"}))
    assert "key" not in repr(SECRET)


def test_a_secret_file_others_may_read_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text("sixteen chars or more\n")
    os.chmod(path, 0o644)
    with pytest.raises(InvalidUsageError, match=r"mode 0644.*chmod 600"):
        read_secret_file(str(path))
    os.chmod(path, 0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(InvalidUsageError, match="symbolic link"):
        read_secret_file(str(link))
    with pytest.raises(InvalidUsageError, match="not a regular file"):
        read_secret_file(str(tmp_path))


def test_a_short_secret_and_two_sources_are_refused():
    with pytest.raises(InvalidUsageError, match="at least 16"):
        secret_from_text("short", "COMMLIB_JOB_SECRET")
    with pytest.raises(InvalidUsageError, match="set one"):
        configured_secret(Config(job_secret="sixteen chars or more", job_secret_file="/x"))


def test_share_secret_agrees_generates_or_names_the_ranks_without_one():
    from commlib.rendezvous import StoreRendezvous, TCPStore, TCPStoreServer, share_secret

    server = TCPStoreServer("127.0.0.1", 0, None).start()
    try:
        def run(configured):
            rendezvous = [StoreRendezvous(TCPStore("127.0.0.1", server.port, None), rank, 3,
                                          prefix=f"share{id(configured)}", timeout=10) for rank in range(3)]
            results = [None] * 3

            def body(rank):
                try:
                    results[rank] = share_secret(rendezvous[rank], configured[rank])
                except Exception as error:  # noqa: BLE001 - compared below
                    results[rank] = error

            threads = [threading.Thread(target=body, args=(rank,)) for rank in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            return results

        generated = run([None, None, None])
        assert len({secret.key for secret in generated}) == 1 and "rank 0" in generated[0].source
        agreed = run([SECRET, SECRET, SECRET])
        assert all(secret is SECRET for secret in agreed)
        mixed = run([SECRET, None, SECRET])
        assert all(isinstance(error, InvalidUsageError) and "rank 1 has none" in str(error) for error in mixed)
        differ = run([SECRET, OTHER, SECRET])
        assert all(isinstance(error, InvalidUsageError) and "they differ" in str(error) for error in differ)
    finally:
        server.close()


# -- the handshake -----------------------------------------------------------------------------
def handshake(server_secret, client_secret, *, server_purpose="store", client_purpose="store",
              accept_claim=None, client_claim=b"rank 1"):
    server = ServerHandshake(server_secret, server_purpose, b"rank 0", accept_claim=accept_claim)
    client = ClientHandshake(client_secret, client_purpose, client_claim)
    response = client.answer(server.challenge())
    try:
        reply = server.respond(response)
    except AuthenticationError as error:
        with pytest.raises(AuthenticationError):
            client.finish(error.reply)
        raise
    return server.peer_claim, client.finish(reply)


def test_both_ends_learn_each_others_claim():
    assert handshake(SECRET, SECRET) == (b"rank 1", b"rank 0")


def test_another_jobs_secret_is_named_on_both_sides():
    with pytest.raises(AuthenticationError, match="another job's secret") as caught:
        handshake(SECRET, OTHER)
    assert caught.value.reason == 3
    server = ServerHandshake(SECRET, "store")
    client = ClientHandshake(OTHER, "store")
    with pytest.raises(AuthenticationError) as refused:
        server.respond(client.answer(server.challenge()))
    with pytest.raises(AuthenticationError, match="another job's secret"):
        client.finish(refused.value.reply)


def test_a_handshake_for_another_service_is_refused():
    with pytest.raises(AuthenticationError, match="another service"):
        handshake(SECRET, SECRET, server_purpose="store", client_purpose="transport")


def test_a_replayed_response_fails_on_a_new_challenge():
    first = ServerHandshake(SECRET, "store")
    client = ClientHandshake(SECRET, "store")
    captured = client.answer(first.challenge())
    first.respond(captured)  # the real connection: accepted
    second = ServerHandshake(SECRET, "store")
    second.challenge()
    with pytest.raises(AuthenticationError, match="forged or replayed") as caught:
        second.respond(captured)
    assert caught.value.reason == 4


def test_a_replayed_confirmation_fails_on_a_new_client():
    server = ServerHandshake(SECRET, "store")
    first = ClientHandshake(SECRET, "store")
    confirm = server.respond(first.answer(server.challenge()))
    second = ClientHandshake(SECRET, "store")
    second.answer(server.challenge())
    with pytest.raises(AuthenticationError, match="forged or replayed"):
        second.finish(confirm)


def test_a_refused_claim_says_why():
    with pytest.raises(AuthenticationError, match="claim was refused: not welcome"):
        handshake(SECRET, SECRET, accept_claim=lambda claim: "not welcome")


def test_binding_ties_the_handshake_to_the_channel():
    server = ServerHandshake(SECRET, "transport", binding=b"server's certificate")
    client = ClientHandshake(SECRET, "transport", binding=b"a man in the middle's certificate")
    with pytest.raises(AuthenticationError, match="forged or replayed"):
        server.respond(client.answer(server.challenge()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_any_bytes_are_a_named_refusal_never_a_crash(data):
    server = ServerHandshake(SECRET, "store")
    server.challenge()
    for attempt in (lambda: server.respond(data), lambda: ClientHandshake(SECRET, "store").answer(data),
                    lambda: ClientHandshake(SECRET, "store").finish(data)):
        with pytest.raises(AuthenticationError):
            attempt()


@settings(max_examples=300, deadline=None)
@given(st.integers(0, RESPONSE_BYTES - 1), st.integers(1, 255))
def test_fuzz_every_flipped_byte_of_a_response_is_refused(position, flip):
    server = ServerHandshake(SECRET, "store", accept_claim=lambda claim: None)
    response = bytearray(ClientHandshake(SECRET, "store", b"rank 1").answer(server.challenge()))
    response[position] ^= flip
    with pytest.raises(AuthenticationError):
        server.respond(bytes(response))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, REPLY_BYTES - 1), st.integers(1, 255))
def test_fuzz_every_flipped_byte_of_a_confirmation_is_refused(position, flip):
    server = ServerHandshake(SECRET, "store", b"rank 0")
    client = ClientHandshake(SECRET, "store")
    reply = bytearray(server.respond(client.answer(server.challenge())))
    reply[position] ^= flip
    with pytest.raises(AuthenticationError):
        client.finish(bytes(reply))


def test_message_sizes_are_fixed():
    server = ServerHandshake(SECRET, "store")
    client = ClientHandshake(SECRET, "store")
    challenge = server.challenge()
    response = client.answer(challenge)
    assert (len(challenge), len(response), len(server.respond(response))) == (CHALLENGE_BYTES, RESPONSE_BYTES,
                                                                             REPLY_BYTES)


def test_authenticate_over_a_socket_and_a_silent_peer_times_out():
    left, right = socket.socketpair()
    claims = {}
    thread = threading.Thread(target=lambda: claims.update(server=authenticate(
        left, SECRET, "server", 5, purpose="transport", claim=b"s")))
    thread.start()
    claims["client"] = authenticate(right, SECRET, "client", 5, purpose="transport", claim=b"c")
    thread.join(10)
    assert claims == {"server": b"c", "client": b"s"}
    silent, _peer = socket.socketpair()
    with pytest.raises(AuthenticationError, match="timed out"):
        authenticate(silent, SECRET, "server", 0.2, purpose="transport")


def test_refusals_are_logged_once_per_source_and_reason(caplog):
    log = RefusalLog("test service", quiet=3600)
    with caplog.at_level(logging.WARNING, logger="commlib.auth"):
        for port in range(1000, 1100):
            log.refuse(f"10.0.0.9:{port}", "another job's secret")
        log.refuse("10.0.0.8:5", "not a commlib handshake")
        log.refuse("10.0.0.8:6", "not a commlib handshake (first bytes b'GET / HT')")  # the same stranger
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["test service: refused a connection from 10.0.0.9:1000: another job's secret",
                     "test service: refused a connection from 10.0.0.8:5: not a commlib handshake"]
    assert log.refused == 102


def test_generated_secrets_differ():
    assert generate_secret().key != generate_secret().key


# -- the store's frames ------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_store_frames_decode_or_raise_protocol_error(data):
    try:
        code, fields = decode(data)
    except ProtocolError:
        return
    assert encode(code, fields)[4:] == data


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=6), st.integers(0, 255), st.integers(1, 17))
def test_fuzz_frame_reader_reassembles_any_cut(fields, code, cut):
    wire = encode(code, fields) * 3
    reader = FrameReader(1 << 16)
    bodies = []
    for start in range(0, len(wire), cut):
        reader.feed(wire[start:start + cut])
        while (body := reader.next_body()) is not None:
            bodies.append(decode(body))
    assert bodies == [(code, fields)] * 3


def test_a_frame_announcing_more_than_the_bound_is_an_error_not_an_allocation():
    reader = FrameReader(1 << 20)
    with pytest.raises(ProtocolError, match="announces 4294967295 bytes; this store accepts at most 1048576"):
        reader.feed((0xFFFFFFFF).to_bytes(4, "little") + b"\x01")
    assert reader.buffered <= 5
