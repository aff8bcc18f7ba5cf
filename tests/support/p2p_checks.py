"""The checks of a group's point-to-point channel, written once for every channel.

``p2p`` is anything with ``rank``, ``size``, ``send``/``recv``/``isend``/``irecv`` and
``monitored_barrier`` (a :class:`commlib.ProcessGroup` under mpiexec, a
:class:`commlib.group.socket_p2p.SocketPointToPoint` in a socket world); ``sync()`` is a barrier
outside that channel (``MPI.COMM_WORLD.Barrier``, the socket transport's own barrier), used
where a check needs every rank at one point before it goes on; ``check`` a
:class:`tests.support.verdict.Checker` (or a :class:`~tests.support.verdict.LocalChecker`).
Payloads have closed forms (:func:`payload`); every check is valid at any world size >= 2.
"""

from __future__ import annotations

import numpy as np

from commlib import ANY_SOURCE, CommError, CommTimeoutError, InvalidUsageError
from tests.support.closed_form import DTYPES

EAGER_SAFE = 1 << 22  # bytes no MPI (and no socket channel) sends eagerly: the send waits for its receive


def payload(src, dst, count, dtype, tag=0):
    return ((np.arange(count) * 3 + src * 11 + dst * 5 + tag) % 113).astype(dtype)


def check_blocking_and_nonblocking(check, p2p, sync=None):
    rank, size = p2p.rank, p2p.size
    right, left = (rank + 1) % size, (rank - 1) % size
    for dtype in map(np.dtype, DTYPES):
        for count in (0, 1, 5, 1000):
            for tag in (0, 7):
                out = payload(rank, right, count, dtype, tag)
                got = np.full(count, 99, dtype)
                if rank % 2 == 0:  # blocking both ways without deadlock: evens send first
                    p2p.send(out, right, tag)
                    source = p2p.recv(got, left, tag)
                else:
                    source = p2p.recv(got, left, tag)
                    p2p.send(out, right, tag)
                check.check(source == left, f"recv returned {source}, expected {left}")
                check.equal(got, payload(left, rank, count, dtype, tag), f"send/recv {dtype} n={count} tag={tag}")
    # Many in flight, both directions, waited in reverse order; distinct tags keep them apart.
    sends, recvs = [], []
    for index in range(20):
        recvs.append((p2p.irecv(np.empty(100 + index, np.int64), left, tag=index), index))
        sends.append(p2p.isend(payload(rank, right, 100 + index, np.int64, index), right, tag=index))
    for work, index in reversed(recvs):
        check.check(work.wait() is True and work.source == left, f"irecv #{index}: source {work.source}")
        check.equal(work.result(), payload(left, rank, 100 + index, np.int64, index), f"irecv #{index}")
    for work in sends:
        work.wait()
    # Same tag, several messages: the order between one pair is kept.
    slots = [np.empty(3, np.int32) for _ in range(5)]
    works = [p2p.irecv(buf, left, tag=3) for buf in slots]
    for index in range(5):
        p2p.isend(np.full(3, index, np.int32), right, tag=3).wait()
    for index, work in enumerate(works):
        work.wait()
        check.equal(slots[index], np.full(3, index, np.int32), f"same-tag message #{index} in order")


def check_out_of_order_and_large(check, p2p, sync):
    """Receives taken in another order than the sends (tags tell them apart), messages that arrive
    before their receive is posted, and messages above any eager limit and above a 4 MiB frame."""
    rank, size = p2p.rank, p2p.size
    right, left = (rank + 1) % size, (rank - 1) % size
    counts = {40: 10, 41: 5 << 20, 42: 3, 43: (9 << 20) // 8 + 5}  # tag -> float64 elements
    sends = [p2p.isend(payload(rank, right, count, np.float64, tag), right, tag=tag) for tag, count in counts.items()]
    sync()  # the small ones arrived before any receive was posted
    for tag in (43, 42, 41, 40):  # the reverse of the sends' order
        got = np.empty(counts[tag], np.float64)
        source = p2p.recv(got, left, tag=tag)
        check.check(source == left, f"out-of-order recv tag {tag}: source {source}")
        check.equal(got, payload(left, rank, counts[tag], np.float64, tag), f"out-of-order recv tag {tag}")
    for work in sends:
        work.wait()
    # Many unexpected small messages from every rank to rank 0, then taken by ANY_SOURCE in a loop.
    per_rank = 50
    if rank != 0:
        for index in range(per_rank):
            p2p.send(np.full(8, rank * 1000 + index, np.int32), 0, tag=44)
    sync()
    if rank == 0:
        seen: dict[int, list[int]] = {peer: [] for peer in range(1, size)}
        for _ in range(per_rank * (size - 1)):
            buf = np.empty(8, np.int32)
            source = p2p.recv(buf, ANY_SOURCE, tag=44)
            seen.setdefault(source, []).append(int(buf[0]) - source * 1000)
            check.check(np.all(buf == buf[0]), f"ANY_SOURCE message from {source} torn: {buf}")
        for peer in range(1, size):
            check.check(seen.get(peer) == list(range(per_rank)), f"messages of rank {peer} in order: {seen.get(peer)}")
    sync()


def check_any_source(check, p2p, sync):
    rank, size = p2p.rank, p2p.size
    if rank == 0:
        sources = []
        for _ in range(size - 1):
            buf = np.empty(4, np.int32)
            source = p2p.recv(buf, ANY_SOURCE, tag=11)
            sources.append(source)
            check.equal(buf, np.full(4, source, np.int32), f"ANY_SOURCE message from {source}")
        check.check(sorted(sources) == list(range(1, size)), f"ANY_SOURCE senders {sources}")
        work = p2p.irecv(np.empty(2, np.float64), ANY_SOURCE, tag=12)
        sync()
        work.wait()
        check.check(work.source == size - 1, f"irecv(ANY_SOURCE) source {work.source}")
    else:
        p2p.send(np.full(4, rank, np.int32), 0, tag=11)
        sync()
        if rank == size - 1:
            p2p.send(np.ones(2), 0, tag=12)


def check_errors(check, p2p, sync):
    """Timeouts, size mismatches and usage errors, each named; point-to-point goes on after them."""
    rank, size = p2p.rank, p2p.size
    sync()
    if rank == 0:
        error = check.raises(CommTimeoutError, lambda: p2p.recv(np.empty(8, np.float32), 1, tag=31, timeout=0.3),
                             "recv nobody sends", match="rank 0: recv")
        for needle in ("from rank 1", "tag 31", "32 B", "timed out after 0.3 s"):
            check.check(error is not None and needle in str(error), f"recv timeout message lacks {needle!r}: {error}")
        work = p2p.irecv(np.empty(2, np.int8), ANY_SOURCE, tag=32, timeout=0.3)
        error = check.raises(CommTimeoutError, work.wait, "irecv nobody sends", match="from any rank (tag 32")
        big = np.zeros(EAGER_SAFE // 8)
        work = p2p.isend(big, 1, tag=33, timeout=0.3)
        error = check.raises(CommTimeoutError, work.wait, "isend nobody receives", match="to rank 1 (tag 33")
        check.check(error is not None and "4 MiB" in str(error), f"isend timeout message lacks the bytes: {error}")
        if error is not None and "take the message back" in str(error):
            print(f"isend timeout: {error}", flush=True)
        p2p.send(np.zeros(2), 1, tag=36)  # point-to-point goes on after a timeout
    elif rank == 1:
        p2p.recv(np.empty(2), 0, tag=36)
    sync()
    # Sizes must match: a short message and a long one.
    if rank == 1:
        p2p.send(np.ones(4, np.float32), 0, tag=34)
        p2p.send(np.ones(16, np.float32), 0, tag=35)
    elif rank == 0:
        check.raises(CommError, lambda: p2p.recv(np.empty(8, np.float32), 1, tag=34),
                     "recv of a short message", match="rank 1 sent 16 B; expected 32 B")
        check.raises(CommError, lambda: p2p.irecv(np.empty(8, np.float32), 1, tag=35).wait(),
                     "irecv of a long message", match="does not fit the receive buffer of 32 B")
    # Usage errors, raised before anything is sent.
    for bad, needle in (((np.ones(2), rank), "cannot exchange a message with itself"),
                        ((np.ones(2), size), f"rank {size} out of range"),
                        ((np.ones(2), (rank + 1) % size, -1), "tag -1 out of range"),
                        ((np.ones(2), (rank + 1) % size, 1 << 40), "out of range"),
                        ((np.ones(4)[::2], (rank + 1) % size), "C-contiguous")):
        check.raises(InvalidUsageError, lambda bad=bad: p2p.send(*bad), f"send{bad[1:]}", match=needle)
    readonly = np.ones(2)
    readonly.setflags(write=False)
    check.raises(InvalidUsageError, lambda: p2p.recv(readonly, (rank + 1) % size), "recv into read-only",
                 match="read-only")
    check.raises(InvalidUsageError, lambda: p2p.send(np.ones(2), ANY_SOURCE), "send to ANY_SOURCE",
                 match="out of range")
    sync()


def check_monitored_barrier(check, p2p, sync):
    rank, size = p2p.rank, p2p.size
    p2p.monitored_barrier(timeout=30)
    check.check(True, "monitored_barrier with everyone")
    late = size - 1
    if rank != late:
        error = check.raises(CommTimeoutError, lambda: p2p.monitored_barrier(timeout=0.5),
                             "monitored_barrier with a late rank", match=f"rank(s) {late} did not arrive within 0.5 s")
        if rank == 0 and error is not None:
            print(f"monitored_barrier: {error}", flush=True)
    sync()
    if rank == late:  # comes after rank 0 gave up: nobody releases it
        check.raises(CommTimeoutError, lambda: p2p.monitored_barrier(timeout=0.5), "the late rank",
                     match="waiting for rank 0 to release it")
    sync()
    if size >= 3:  # two missing ranks: named both with wait_all_ranks, the lowest without
        missing = [1, 2]
        for wait_all in (True, False):
            if rank not in missing:
                shown = "1, 2" if wait_all else "1 did"
                check.raises(CommTimeoutError,
                             lambda wait_all=wait_all: p2p.monitored_barrier(timeout=0.5, wait_all_ranks=wait_all),
                             f"monitored_barrier wait_all_ranks={wait_all}", match=f"rank(s) {shown}")
            sync()
            if rank in missing:
                check.raises(CommTimeoutError, lambda: p2p.monitored_barrier(timeout=0.5), "late", match="rank 0")
            sync()
    p2p.monitored_barrier(timeout=30)  # late tokens of earlier barriers do not confuse this one
    check.check(True, "monitored_barrier after failures")


def check_separate_from_collectives(check, pg, sync):
    """(A group's.) Wildcard receives with the next collectives' tags are posted across those
    collectives. ``sync`` must not be one of the group's collectives."""
    rank, size = pg.rank, pg.size
    tags = [(pg.seq + k) % 32768 for k in (1, 2, 3)]  # the next collectives' tags (MPI's: seq mod 32768)
    pending = [pg.irecv(np.empty(1 << 10, np.uint8), ANY_SOURCE, tag=tag) for tag in tags] if rank == 0 else []
    seq_before = pg.seq
    for algorithm in ("ring", "recursive_doubling"):
        buf = np.full(1 << 10, rank, np.uint8)
        pg.allreduce(buf, algorithm=algorithm)
        check.equal(buf, np.full(1 << 10, sum(range(size)) % 256, np.uint8), f"allreduce {algorithm} beside p2p")
    out = np.empty(size * 8, np.uint8)
    pg.allgather(out, np.full(8, rank, np.uint8), algorithm="ring")
    check.equal(out, np.repeat(np.arange(size, dtype=np.uint8), 8), "allgather beside p2p")
    check.check(pg.seq == seq_before + 3, f"collectives took {pg.seq - seq_before} numbers, expected 3")
    if rank == 0:
        check.check(not any(work.is_completed() for work in pending), "a p2p receive matched a collective's message")
    sync()  # rank 1 sends the real messages only after the look
    seq_before = pg.seq
    if rank == 1:
        for k, tag in enumerate(tags):
            pg.send(np.full(1 << 10, 100 + k, np.uint8), 0, tag=tag)
    if rank == 0:
        for k, work in enumerate(pending):
            work.wait()
            check.equal(work.result(), np.full(1 << 10, 100 + k, np.uint8), f"p2p message #{k} after the collectives")
    check.check(pg.seq == seq_before, f"point-to-point took {pg.seq - seq_before} collective numbers")
    pg.barrier()


def check_blocked_recv_does_not_stall_the_comm_thread(check, pg):
    """(A group's.) A blocked ``recv`` does not stall the collectives on the comm thread."""
    rank, size = pg.rank, pg.size
    buf = np.full(64, rank + 1.0)
    if rank == 0:
        work = pg.allreduce(buf, async_op=True)  # runs on the comm thread ...
        token = np.empty(1)
        pg.recv(token, 1, tag=21, timeout=30)  # ... while this thread blocks until rank 1 finished it
        work.wait()
        check.check(token[0] == 42.0, "token")
    else:
        pg.allreduce(buf)
        if rank == 1:
            pg.send(np.array([42.0]), 0, tag=21)
    check.equal(buf, np.full(64, size * (size + 1) / 2), "async allreduce beside a blocked recv")


def check_all(check, p2p, sync):
    """Every check above, in order."""
    check_blocking_and_nonblocking(check, p2p, sync)
    check_out_of_order_and_large(check, p2p, sync)
    check_any_source(check, p2p, sync)
    check_errors(check, p2p, sync)
    check_monitored_barrier(check, p2p, sync)

