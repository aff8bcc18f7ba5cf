"""The socket transport's small-allreduce fast path over a real socket pair, the test playing rank 1.

The fast path writes and reads the socket directly; what it must keep is the general path's
wire format and its failures: the frame it sends is the one ``native_allreduce`` sends; a
peer's frame that is early, late, of another collective, or a peer that left, each end as the
engine ends them (the result, or a named error); a socket that takes only part of the frame
is finished by the engine; and a call it cannot take leaves the socket untouched.
"""

import select
import socket
import threading
import time

import numpy as np
import pytest

from commlib.errors import CollectiveMismatchError, PeerExitedError
from commlib.ops import DTYPE_IS_FLOAT, ReduceOp
from commlib.transports.socket.connection import Connection
from commlib.transports.socket.fast_path import FAST_SPIN_SECONDS, make_inline_native
from commlib.transports.socket.framing import ABORT, FrameCodec
from commlib.transports.socket.natives import SocketNativeCollectives
from commlib.transports.socket.progress import ProgressEngine
from tests.support.raw_socket import read_exactly

JOB, GROUP = b"j" * 8, b"g" * 8
FRAME = 4 << 20
INF = float("inf")


class PairRank(SocketNativeCollectives):
    """One rank of two over one end of a socket pair: the socket transport's engine and natives."""

    xp = np

    def __init__(self, rank, sock):
        super().__init__()
        self.rank, self.size = rank, 2
        self.progress_board = None
        self.codec = FrameCodec(True, JOB, GROUP, FRAME)
        links = [None, None]
        links[1 - rank] = Connection(sock, 1 - rank, f"host-{1 - rank}", self.codec)
        self.engine = ProgressEngine(rank, links, self.context)

    def post(self, sends=(), recvs=()):
        return self.engine.post(sends, recvs)


class Peer:
    """Rank 1, played frame by frame by the test."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.rank0 = PairRank(0, theirs)
        self.codec = self.rank0.codec
        self.run = make_inline_native(self.rank0, "allreduce", 30.0)

    def frame(self, seq, payload, step=0, total=None):
        total = len(payload) if total is None else total
        return self.codec.data_header(seq, step, 0, len(payload), total) + payload

    def read(self, count, timeout=10.0):
        self.sock.settimeout(timeout)
        return read_exactly(self.sock, count)

    def nothing_written(self):
        try:
            self.sock.recv(1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        return False


@pytest.fixture
def peer():
    peer = Peer()
    yield peer
    peer.sock.close()  # first: rank 0's close after a failure lingers until its peer has gone
    peer.rank0.engine.close()


def test_the_frame_sent_is_the_general_paths_and_an_early_peer_frame_is_reduced(peer):
    mine, theirs = np.arange(5, dtype=np.int64), np.full(5, 10, np.int64)
    peer.sock.sendall(peer.frame(1, theirs.tobytes()))  # the peer is ahead: its frame waits in the kernel
    assert peer.run(1, INF, mine, ReduceOp.SUM) is True
    assert mine.tolist() == [10, 11, 12, 13, 14]
    assert peer.read(peer.codec.header_bytes + 40) == peer.frame(1, np.arange(5, dtype=np.int64).tobytes())
    assert peer.rank0.context.seq == 1 and peer.rank0.context.collective == "idle"  # no general machinery


def test_a_late_peer_frame_is_waited_for_by_the_engine(peer):
    mine = np.ones(3, np.float32)
    context = peer.rank0.context

    def send_once_the_engine_waits():  # an order, not a time: the frame comes after the spin gave up
        deadline = time.monotonic() + 30
        while context.collective != "allreduce" and time.monotonic() < deadline:
            time.sleep(FAST_SPIN_SECONDS)
        peer.sock.sendall(peer.frame(1, np.full(3, 2, np.float32).tobytes()))

    sender = threading.Thread(target=send_once_the_engine_waits)
    sender.start()
    assert peer.run(1, INF, mine, ReduceOp.MAX) is True
    sender.join()
    assert mine.tolist() == [2, 2, 2]
    # The engine took over: the context began (the deadline counts from there).
    assert context.collective == "allreduce" and context.step == "native allreduce: round 0"


def test_a_frame_of_another_size_is_a_named_mismatch_and_the_peer_hears_of_it(peer):
    peer.sock.sendall(peer.frame(1, bytes(16)))
    with pytest.raises(CollectiveMismatchError, match="a message of 16 B where this rank posted a receive of 8 B"):
        peer.run(1, INF, np.ones(1, np.int64), ReduceOp.SUM)
    sent = peer.read(peer.codec.header_bytes + 8)
    assert sent == peer.frame(1, np.ones(1, np.int64).tobytes())
    assert peer.codec.parse(peer.read(peer.codec.header_bytes)).type == ABORT


def test_a_peer_that_left_is_peer_exited_error_naming_it(peer):
    peer.sock.close()
    with pytest.raises(PeerExitedError, match=r"rank 1 \(host host-1\)"):
        peer.run(1, INF, np.ones(2, np.float64), ReduceOp.SUM)


def test_a_frame_the_socket_takes_only_in_part_is_finished_by_the_engine(peer):
    sock = peer.rank0.engine.connections[1].sock
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    junk = 0
    while True:  # fill the socket pair's buffer: the fast path's frame cannot go out whole
        try:
            junk += sock.send(b"\0" * 4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
    mine = np.arange(4096, dtype=np.float64)  # 32 KiB
    outcome = {}

    def rank0():
        outcome["took"] = peer.run(1, INF, mine, ReduceOp.SUM)

    thread = threading.Thread(target=rank0)
    thread.start()
    connection = peer.rank0.engine.connections[1]
    deadline = time.monotonic() + 30
    while not connection.send_queue and time.monotonic() < deadline:  # the engine holds the rest
        time.sleep(1e-3)
    assert connection.send_queue, "the frame went out whole: the buffer was not full"
    peer.read(junk)
    frame = peer.read(peer.codec.header_bytes + mine.nbytes)
    peer.sock.sendall(peer.frame(1, np.ones(4096, np.float64).tobytes()))
    thread.join(30)
    assert outcome == {"took": True}
    assert frame == peer.frame(1, np.arange(4096, dtype=np.float64).tobytes())
    assert np.array_equal(mine, np.arange(4096, dtype=np.float64) + 1)


def _park_the_second_of_two_frames(peer, second):
    """Collective #1 on the general path while the peer's frames of #1 and (part of) #2 are
    there: the engine reads #2's header ahead and parks it."""
    peer.sock.sendall(peer.frame(1, np.ones(2, np.int64).tobytes()) + second)  # in rank 0's buffer on return
    first = np.ones(2, np.int64)
    peer.rank0.context.begin("allreduce", 1, "native", first.nbytes, 30.0)
    peer.rank0.native_allreduce(first, ReduceOp.SUM)
    assert first.tolist() == [2, 2] and peer.rank0.engine.connections[1].parked
    peer.read(peer.codec.header_bytes + 16)  # rank 0's frame of #1


def test_a_header_the_engine_parked_is_read_on_by_the_fast_path(peer):
    _park_the_second_of_two_frames(peer, peer.frame(2, np.full(2, 5, np.int64).tobytes()))
    mine = np.ones(2, np.int64)
    assert peer.run(2, INF, mine, ReduceOp.SUM) is True
    connection = peer.rank0.engine.connections[1]
    assert mine.tolist() == [6, 6] and not connection.parked and connection.quiet()
    assert connection.interest & select.EPOLLIN  # watched for input again
    assert peer.rank0.context.collective == "allreduce" and peer.rank0.context.seq == 2  # no engine wait began
    peer.sock.sendall(peer.frame(3, np.full(2, 7, np.int64).tobytes()))  # and the next call is fast too
    assert peer.run(3, INF, mine, ReduceOp.MAX) is True and mine.tolist() == [7, 7]
    assert peer.rank0.context.seq == 3


def test_a_parked_frame_whose_payload_is_late_is_finished_by_the_engine(peer):
    frame = peer.frame(2, np.full(2, 5, np.int64).tobytes())
    _park_the_second_of_two_frames(peer, frame[:-5])
    timer = threading.Timer(0.1, lambda: peer.sock.sendall(frame[-5:]))
    timer.start()
    mine = np.ones(2, np.int64)
    assert peer.run(2, INF, mine, ReduceOp.SUM) is True
    timer.join()
    assert mine.tolist() == [6, 6] and peer.rank0.context.step == "native allreduce: round 0"


def test_a_header_the_engine_read_in_part_is_read_on_by_the_engine(peer):
    frame = peer.frame(2, np.full(2, 5, np.int64).tobytes())
    peer.sock.sendall(peer.frame(1, np.ones(2, np.int64).tobytes()) + frame[:10])
    first = np.ones(2, np.int64)
    peer.rank0.context.begin("allreduce", 1, "native", first.nbytes, 30.0)
    peer.rank0.native_allreduce(first, ReduceOp.SUM)
    connection = peer.rank0.engine.connections[1]
    assert connection.header_have == 10 and not connection.parked and connection.quiet()
    peer.sock.sendall(frame[10:])
    mine = np.ones(2, np.int64)
    assert peer.run(2, INF, mine, ReduceOp.SUM) is True
    assert mine.tolist() == [6, 6] and connection.header_have == 0


def test_a_parked_frame_of_another_collective_is_a_named_mismatch(peer):
    _park_the_second_of_two_frames(peer, peer.frame(3, bytes(16)))
    with pytest.raises(CollectiveMismatchError, match=r"collective #3 \(message 0\) where this rank expects #2"):
        peer.run(2, INF, np.ones(2, np.int64), ReduceOp.SUM)


@pytest.mark.parametrize("why,buf,op,limit", [
    ("strided", np.ones(8, np.int64)[::2], ReduceOp.SUM, INF),
    ("read-only", np.ones(4, np.int64).copy().view(), ReduceOp.SUM, INF),
    ("AVG divides", np.ones(4, np.float32), ReduceOp.AVG, INF),
    ("a dtype the general path refuses", np.ones(4, np.complex64), ReduceOp.SUM, INF),
    ("above the limit", np.ones(4, np.int64), ReduceOp.SUM, 16),
    ("above one bounce buffer", np.ones(16385, np.float32), ReduceOp.SUM, INF),
    ("empty", np.ones(0, np.float32), ReduceOp.SUM, INF),
])
def test_a_call_it_cannot_take_touches_nothing(peer, why, buf, op, limit):
    if why == "read-only":
        buf.flags.writeable = False
    assert peer.run(1, limit, buf, op) is False, why
    assert peer.nothing_written() and peer.rank0.context.seq == 0, why


def test_a_connection_with_a_receive_in_flight_is_left_to_the_general_path(peer):
    pending = peer.rank0.post(recvs=((np.zeros(2, np.int64), 1),))
    assert peer.run(2, INF, np.ones(2, np.int64), ReduceOp.SUM) is False
    assert peer.nothing_written()
    peer.sock.sendall(peer.frame(0, bytes(16)))
    pending.wait()


def test_each_dtype_and_op_matches_the_general_path_bit_for_bit():
    """Rank 0 on the fast path, rank 1 (a thread) on the general path: every result equal."""
    ours, theirs = socket.socketpair()
    fast, general = PairRank(0, ours), PairRank(1, theirs)
    run = make_inline_native(fast, "allreduce", 30.0)
    rng = np.random.default_rng(3)
    seq = 0
    try:
        for dtype in DTYPE_IS_FLOAT:
            for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD, "max"):
                seq += 1
                values = [rng.standard_normal(37).astype(dtype) for _ in range(2)]
                results = [values[0].copy(), values[1].copy()]
                errors = []

                def other(seq=seq, op=op, buf=results[1], errors=errors):
                    try:
                        general.context.begin("allreduce", seq, "native", buf.nbytes, 30.0)
                        general.native_allreduce(buf, ReduceOp.coerce(op))
                    except Exception as error:  # noqa: BLE001 - reported below
                        errors.append(error)

                thread = threading.Thread(target=other)
                thread.start()
                assert run(seq, INF, results[0], op) is True
                thread.join(30)
                assert not errors, errors
                assert results[0].tobytes() == results[1].tobytes(), (dtype, op)
    finally:
        fast.engine.close()
        general.engine.close()
