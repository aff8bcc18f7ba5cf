"""mpiexec -n P python tests/mpi/p2p_check.py        (P >= 2)

Point-to-point through the public ``ProcessGroup``: send/recv/isend/irecv over dtypes and sizes
(0 included) and tags, ``ANY_SOURCE`` naming the sender, many messages in flight waited in
reverse; that point-to-point never matches a collective's messages (same tag numbers, wildcard
receives posted across collectives), takes no collective sequence number, and that a blocked
``recv`` does not stall the group's comm thread; timeouts and size mismatches as errors naming
rank, peer, tag and bytes; the monitored barrier naming the ranks that did not arrive.
"""

import numpy as np
from mpi4py import MPI

import commlib
from commlib import ANY_SOURCE, CommError, CommTimeoutError, InvalidUsageError
from verdict import DTYPES, Checker

EAGER_SAFE = 1 << 22  # bytes no MPI sends eagerly: the send waits for its receive


def payload(src, dst, count, dtype, tag=0):
    return ((np.arange(count) * 3 + src * 11 + dst * 5 + tag) % 113).astype(dtype)


def check_blocking_and_nonblocking(check, pg):
    rank, size = pg.rank, pg.size
    right, left = (rank + 1) % size, (rank - 1) % size
    for dtype in map(np.dtype, DTYPES):
        for count in (0, 1, 5, 1000):
            for tag in (0, 7):
                out = payload(rank, right, count, dtype, tag)
                got = np.full(count, 99, dtype)
                if rank % 2 == 0:  # blocking both ways without deadlock: evens send first
                    pg.send(out, right, tag)
                    source = pg.recv(got, left, tag)
                else:
                    source = pg.recv(got, left, tag)
                    pg.send(out, right, tag)
                check.check(source == left, f"recv returned {source}, expected {left}")
                check.equal(got, payload(left, rank, count, dtype, tag), f"send/recv {dtype} n={count} tag={tag}")
    # Many in flight, both directions, waited in reverse order; distinct tags keep them apart.
    sends, recvs = [], []
    for index in range(20):
        recvs.append((pg.irecv(np.empty(100 + index, np.int64), left, tag=index), index))
        sends.append(pg.isend(payload(rank, right, 100 + index, np.int64, index), right, tag=index))
    for work, index in reversed(recvs):
        check.check(work.wait() is True and work.source == left, f"irecv #{index}: source {work.source}")
        check.equal(work.result(), payload(left, rank, 100 + index, np.int64, index), f"irecv #{index}")
    for work in sends:
        work.wait()
    # Same tag, several messages: MPI's order between one pair is kept.
    got = [np.empty(3, np.int32) for _ in range(5)]
    works = [pg.irecv(buf, left, tag=3) for buf in got]
    for index in range(5):
        pg.isend(np.full(3, index, np.int32), right, tag=3).wait()
    for index, work in enumerate(works):
        work.wait()
        check.equal(got[index], np.full(3, index, np.int32), f"same-tag message #{index} in order")


def check_any_source(check, pg):
    rank, size = pg.rank, pg.size
    if rank == 0:
        sources = []
        for _ in range(size - 1):
            buf = np.empty(4, np.int32)
            source = pg.recv(buf, ANY_SOURCE, tag=11)
            sources.append(source)
            check.equal(buf, np.full(4, source, np.int32), f"ANY_SOURCE message from {source}")
        check.check(sorted(sources) == list(range(1, size)), f"ANY_SOURCE senders {sources}")
        work = pg.irecv(np.empty(2, np.float64), ANY_SOURCE, tag=12)
        pg.barrier()
        work.wait()
        check.check(work.source == size - 1, f"irecv(ANY_SOURCE) source {work.source}")
    else:
        pg.send(np.full(4, rank, np.int32), 0, tag=11)
        pg.barrier()
        if rank == size - 1:
            pg.send(np.ones(2), 0, tag=12)


def check_separate_from_collectives(check, pg):
    """Wildcard receives with the next collectives' tags are posted across those collectives."""
    rank, size = pg.rank, pg.size
    seq_before = pg.seq
    pending = None
    if rank == 0:
        # The next collectives carry tags seq+1.., exactly what these receives ask for.
        pending = [pg.irecv(np.empty(1 << 10, np.uint8), ANY_SOURCE, tag=(pg.seq + k) % 32768) for k in (1, 2, 3)]
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
    MPI.COMM_WORLD.Barrier()  # outside commlib: rank 1 sends the real messages only after the look
    seq_before = pg.seq
    if rank != 0:
        for k, work_tag in enumerate((seq_before - 2, seq_before - 1, seq_before)):
            if rank == 1:
                pg.send(np.full(1 << 10, 100 + k, np.uint8), 0, tag=work_tag % 32768)
    if rank == 0:
        for k, work in enumerate(pending):
            work.wait()
            check.equal(work.result(), np.full(1 << 10, 100 + k, np.uint8), f"p2p message #{k} after the collectives")
    check.check(pg.seq == seq_before, f"point-to-point took {pg.seq - seq_before} collective numbers")
    pg.barrier()


def check_blocked_recv_does_not_stall_the_comm_thread(check, pg):
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


def check_errors(check, pg):
    rank, size = pg.rank, pg.size
    MPI.COMM_WORLD.Barrier()
    if rank == 0:
        error = check.raises(CommTimeoutError, lambda: pg.recv(np.empty(8, np.float32), 1, tag=31, timeout=0.3),
                             "recv nobody sends", match="rank 0: recv")
        for needle in ("from rank 1", "tag 31", "32 B", "timed out after 0.3 s"):
            check.check(error is not None and needle in str(error), f"recv timeout message lacks {needle!r}: {error}")
        work = pg.irecv(np.empty(2, np.int8), ANY_SOURCE, tag=32, timeout=0.3)
        error = check.raises(CommTimeoutError, work.wait, "irecv nobody sends", match="from any rank (tag 32")
        big = np.zeros(EAGER_SAFE // 8)
        work = pg.isend(big, 1, tag=33, timeout=0.3)
        error = check.raises(CommTimeoutError, work.wait, "isend nobody receives", match="to rank 1 (tag 33")
        check.check(error is not None and "4 MiB" in str(error), f"isend timeout message lacks the bytes: {error}")
        if error is not None and "take the message back" in str(error):
            print(f"isend timeout: {error}", flush=True)
        pg.send(np.zeros(2), 1, tag=36)  # point-to-point goes on after a timeout
    elif rank == 1:
        pg.recv(np.empty(2), 0, tag=36)
    MPI.COMM_WORLD.Barrier()
    # Sizes must match: a short message and a long one.
    if rank == 1:
        pg.send(np.ones(4, np.float32), 0, tag=34)
        pg.send(np.ones(16, np.float32), 0, tag=35)
    elif rank == 0:
        check.raises(CommError, lambda: pg.recv(np.empty(8, np.float32), 1, tag=34),
                     "recv of a short message", match="rank 1 sent 16 B; expected 32 B")
        check.raises(CommError, lambda: pg.irecv(np.empty(8, np.float32), 1, tag=35).wait(),
                     "irecv of a long message", match="does not fit the receive buffer of 32 B")
    # Usage errors, raised before anything is sent.
    for bad, needle in (((np.ones(2), rank), "cannot exchange a message with itself"),
                        ((np.ones(2), size), f"rank {size} out of range"),
                        ((np.ones(2), (rank + 1) % size, -1), "tag -1 out of range"),
                        ((np.ones(2), (rank + 1) % size, 1 << 40), "out of range"),
                        ((np.ones(4)[::2], (rank + 1) % size), "C-contiguous")):
        check.raises(InvalidUsageError, lambda: pg.send(*bad), f"send{bad[1:]}", match=needle)
    readonly = np.ones(2)
    readonly.setflags(write=False)
    check.raises(InvalidUsageError, lambda: pg.recv(readonly, (rank + 1) % size), "recv into read-only",
                 match="read-only")
    check.raises(InvalidUsageError, lambda: pg.send(np.ones(2), ANY_SOURCE), "send to ANY_SOURCE", match="out of range")
    # The group is fine after all that.
    buf = np.ones(3)
    pg.allreduce(buf)
    check.equal(buf, np.full(3, float(size)), "allreduce after point-to-point errors")
    MPI.COMM_WORLD.Barrier()


def check_monitored_barrier(check, pg):
    rank, size = pg.rank, pg.size
    pg.monitored_barrier(timeout=30)
    check.check(True, "monitored_barrier with everyone")
    late = size - 1
    if rank != late:
        error = check.raises(CommTimeoutError, lambda: pg.monitored_barrier(timeout=0.5),
                             "monitored_barrier with a late rank", match=f"rank(s) {late} did not arrive within 0.5 s")
        if rank == 0 and error is not None:
            print(f"monitored_barrier: {error}", flush=True)
    MPI.COMM_WORLD.Barrier()
    if rank == late:  # comes after rank 0 gave up: nobody releases it
        check.raises(CommTimeoutError, lambda: pg.monitored_barrier(timeout=0.5), "the late rank",
                     match="waiting for rank 0 to release it")
    MPI.COMM_WORLD.Barrier()
    if size >= 3:  # two missing ranks: named both with wait_all_ranks, the lowest without
        missing = [1, 2]
        for wait_all in (True, False):
            if rank not in missing:
                shown = "1, 2" if wait_all else "1 did"
                check.raises(CommTimeoutError, lambda: pg.monitored_barrier(timeout=0.5, wait_all_ranks=wait_all),
                             f"monitored_barrier wait_all_ranks={wait_all}", match=f"rank(s) {shown}")
            MPI.COMM_WORLD.Barrier()
            if rank in missing:
                check.raises(CommTimeoutError, lambda: pg.monitored_barrier(timeout=0.5), "late", match="rank 0")
            MPI.COMM_WORLD.Barrier()
    pg.monitored_barrier(timeout=30)  # late tokens of earlier barriers do not confuse this one
    check.check(True, "monitored_barrier after failures")


def main():
    pg = commlib.init(timeout=60)
    check = Checker()
    if pg.size < 2:
        check.check(False, "p2p_check.py needs at least 2 ranks")
        check.finish()
    seq = pg.seq
    check_blocking_and_nonblocking(check, pg)
    check.check(pg.seq == seq, f"send/recv took {pg.seq - seq} collective numbers")
    check_any_source(check, pg)
    check_separate_from_collectives(check, pg)
    check_blocked_recv_does_not_stall_the_comm_thread(check, pg)
    check_errors(check, pg)
    check_monitored_barrier(check, pg)
    commlib.shutdown()
    check.finish()


if __name__ == "__main__":
    main()
