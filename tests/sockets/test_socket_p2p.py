"""Point-to-point over sockets (``SocketPointToPoint``) in real processes that met through the
store: every check the MPI channel passes (:mod:`tests.support.p2p_checks`, the same closed-form
payloads) at P = 2, 3, 4; a killed peer named within a second; unexpected messages held within
their bound; a send that gave up never received later; threads sharing one channel."""

import shutil
import subprocess
import time

import pytest

from commlib.transports.socket import SocketOptions, TLSFiles
from tests.support.socket_world import RankSetup, SocketWorld

RANKS = "tests.sockets.socket_p2p_ranks"
CHECKS = ["check_blocking_and_nonblocking", "check_out_of_order_and_large", "check_any_source", "check_errors",
          "check_monitored_barrier"]


def on(world, rank, function, *args):
    """What ``function`` of the rank functions returned on ``rank`` alone (its error fails the test)."""
    outcome = world.run_outcomes(f"{RANKS}:{function}", *args, ranks=[rank])[rank]
    assert outcome[0] == "ok", f"rank {rank}: {function}: {outcome}"
    return outcome[1]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_point_to_point_check_passes_over_sockets(size):
    with SocketWorld(size) as world:
        assert all(outcome[0] == "ok" for outcome in world.started), world.started
        assert world.run(f"{RANKS}:open_channel") == [1 << 31] * size
        verdicts = world.run(f"{RANKS}:run_checks", CHECKS, timeout=300)
        assert world.run(f"{RANKS}:threads_ring", 4, 30, timeout=200) == [None] * size
        world.run(f"{RANKS}:close_channel")
    failures = [failure for _, found in verdicts for failure in found]
    assert not failures, "\n".join(failures[:30])
    assert all(count > 150 for count, _ in verdicts), verdicts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size,victim", [(2, 1), (3, 1), (4, 3)])
def test_a_peer_killed_mid_receive_is_peer_exited_error_within_a_second(size, victim):
    with SocketWorld(size) as world:
        world.run(f"{RANKS}:open_channel")
        survivors = [rank for rank in range(size) if rank != victim]
        for rank in survivors:
            world.channels[rank].send((f"{RANKS}:receive_from_until_error", (victim, 60.0)))
        time.sleep(1.0)  # every survivor waits in its receives
        killed = time.monotonic()
        world.kill_rank(victim)
        outcomes = world._gather(60, survivors)
    late = []
    for rank in survivors:
        kind, value = outcomes[rank][:2]
        assert kind == "ok", f"rank {rank}: {outcomes[rank]}"
        for error_type, text, when in value:
            assert error_type == "PeerExitedError", f"rank {rank}: {error_type}: {text}"
            assert f"rank {victim} exited" in text and f"rank {rank}: recv #" in text, text
            late.append(when - killed)
    print(f"p={size}: rank {victim} killed; seen after " + ", ".join(f"{s * 1e3:.1f} ms" for s in late))
    # The kernel closes a killed process's sockets and the epoll wakes: milliseconds, measured
    # (printed above); a second is the bound the channel promises, with the machine's load in it.
    assert max(late) < 1.0, late


@pytest.mark.timeout(300)
def test_unexpected_messages_are_held_within_their_bound_and_the_rest_waits_in_the_kernel():
    bound = 256 << 10
    with SocketWorld(2) as world:
        world.run(f"{RANKS}:open_channel", 60.0, {"eager_bytes": 64 << 10, "max_held_bytes": bound})
        on(world, 1, "flood", 0, 12, 60 << 10, 100)  # 720 KiB, nothing received yet
        time.sleep(1.0)
        count, held_bytes, limit, parked = on(world, 0, "held")
        assert limit == bound and held_bytes <= bound and count == 4 and parked == [1], (count, held_bytes, parked)
        # The last message waits behind the parked one: a receive for it times out, saying why.
        (last,) = on(world, 0, "take", 1, 60 << 10, [111], 0.5)
        assert last.startswith("CommTimeoutError") and "reached the bound" in last and "tags (100, 101" in last, last
        # Taken in order, every message arrives, the parked ones as the held ones are taken.
        assert on(world, 0, "take", 1, 60 << 10, list(range(100, 112))) == [None] * 12
        on(world, 1, "flood_done")
        count, held_bytes, _, parked = on(world, 0, "held")
        assert (count, held_bytes, parked) == (0, 0, []), (count, held_bytes, parked)


@pytest.mark.timeout(300)
def test_a_large_send_that_gave_up_is_never_received_and_a_small_one_may_be():
    with SocketWorld(2) as world:
        world.run(f"{RANKS}:open_channel")
        large = on(world, 1, "send_that_gives_up", 0, 4 << 20, 9, 0.3)
        assert large.startswith("CommTimeoutError") and "to rank 0 (tag 9" in large and "4 MiB" in large, large
        # Its announcement was withdrawn (CANCEL): the next message of that tag is the small one.
        assert on(world, 0, "receive_small", 1, 9) == [7] * 8


@pytest.mark.timeout(300)
def test_point_to_point_over_tls(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=commlib",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True, timeout=120)
    options = SocketOptions(tls=TLSFiles(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")))
    with SocketWorld(3, setup=RankSetup(options=options)) as world:
        world.run(f"{RANKS}:open_channel")
        verdicts = world.run(f"{RANKS}:run_checks", ["check_blocking_and_nonblocking", "check_out_of_order_and_large",
                                                     "check_any_source"], timeout=300)
        assert world.run(f"{RANKS}:threads_ring", 3, 20, timeout=200) == [None] * 3
    failures = [failure for _, found in verdicts for failure in found]
    assert not failures, "\n".join(failures[:30])
