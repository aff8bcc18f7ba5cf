"""The socket transport's small allreduce in the form the group's fast path calls it.

:meth:`SocketTransport.inline_native` hands the group, for ``"allreduce"``, a function
``run(seq, limit, buf, op, _) -> bool`` (see :mod:`commlib.group.fast_path`). It sends exactly
the frames of the general path's ``native_allreduce`` at these sizes (recursive doubling: one
frame each way per round, the same sequence and message numbers, the same operand order), so
a rank on this path and one on the general path (a busy line, ``async_op``) still match, but
with none of its machinery: per round one ``sendmsg`` of header and payload straight from the
caller's buffer, then reads of at most that one frame into the connection's bounce buffer
until it is there, then the reduction from that buffer.

Why it exists: for a message of a few bytes the general path's objects (pending, messages,
views), its epoll and the group's machinery cost several times the exchange itself; the
figures with this path are in docs/benchmarks/launch-sockets-small-2x1.json.

It takes the call only when it can finish it without the engine in the common case (plain
numpy buffer, a dtype and op of the general path's table but AVG, at most one frame the
bounce buffer holds, a power-of-two group, every partner's connection :meth:`quiet`: nothing
queued or buffered, the peer there, no TLS) and returns False otherwise, touching nothing.
Anything unusual once it runs (the socket takes only part of the frame; the peer's frame is
late, not the one expected, or partly read ahead by the engine; the peer left) is handed to the
engine (:meth:`~.progress.ProgressEngine.resume_exchange`) after a short spin: the context
begins there (the deadline counts from then, a spin late), and the engine then waits, fails
and explains exactly as on the general path.

One difference from the general path, by design: this path reads exactly the frames it needs,
so a peer's ABORT that follows its frame of this allreduce (the peer gave up right after
sending) is raised by this rank's next call, not this one. The general path reads ahead and
may raise it in this one when it had arrived in time; neither can promise it (an ABORT a
moment later is the next call's on both), and the result of this call is whole either way.
"""

from __future__ import annotations

import os
import time

import numpy as np

from commlib.ops import DTYPE_IS_FLOAT, ReduceOp, ufunc_name
from commlib.platform.machine import polls_per_yield
from commlib.reliability.progress_board import CODE_BITS, COLLECTIVE_CODES
from commlib.transports.socket.natives import SMALL_BYTES
from commlib.transports.socket.progress import byte_view

__all__ = ["make_inline_native", "FAST_SPIN_SECONDS"]

# How long the fast path polls for the peer's frame before the engine takes over: a few round
# trips within a data centre; past it the engine's own wait (spin, then sleep) carries on.
FAST_SPIN_SECONDS = 100e-6
SCRATCH_SLOT = (1 << 20) + 2  # where a round the engine finishes receives: a slot beside natives.py's
NDARRAY = np.ndarray
_SUM, _MIN, _MAX, _PROD = ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD
# Members matched by identity (hashing an Enum member runs Python code); names by this table,
# the ufuncs the general path reduces with (commlib.ops), AVG left to it (it divides).
_UFUNC_BY_NAME = {name: getattr(np, ufunc_name(op)) for op in ReduceOp if op is not ReduceOp.AVG
                  for name in (op.value, op.name)}


def make_inline_native(transport, collective: str, timeout: float):
    """``run(seq, limit, buf, op, _) -> bool`` for ``collective`` over ``transport`` (a
    SocketTransport), or None where there is no fast path (every collective but allreduce, a
    group whose size is not a power of two, TLS)."""
    if collective != "allreduce":
        return None
    size, rank = transport.size, transport.rank
    if size < 2 or size & (size - 1):
        return None  # the general path folds the extra ranks first: not one frame per round
    engine, context = transport.engine, transport.context
    rounds = []
    mask = 1
    while mask < size:
        peer = rank ^ mask  # recursive doubling's partner (no folded ranks at a power of two)
        connection = engine.connections[peer]
        if connection is None or connection.tls:
            return None
        rounds.append((connection, peer < rank, f"native allreduce: round {mask.bit_length() - 1}",
                       np.frombuffer(connection.bounce, np.uint8)))
        mask <<= 1
    connections = [connection for connection, _, _, _ in rounds]
    # Every round's frame must be one the bounce buffer holds whole (prefetch_limit: one frame at
    # most), and one the general path sends the same way (recursive doubling up to SMALL_BYTES).
    cap = min(SMALL_BYTES, *(connection.prefetch_limit for connection in connections))
    board = transport.progress_board
    slot = board.mine_slot if board is not None else None
    if slot is None:
        slot = [0]  # always a slot to mark: one test less on the path
    started = COLLECTIVE_CODES[collective]
    per_yield = polls_per_yield()
    monotonic, sched_yield = time.monotonic, os.sched_yield

    def allreduce(seq, limit, buf, op, _unused=None):
        if buf.__class__ is not NDARRAY:
            return False
        nbytes = buf.nbytes
        if not 0 < nbytes <= limit or nbytes > cap:
            return False
        flags = buf.flags
        if not (flags.c_contiguous and flags.writeable):
            return False
        ufunc = (np.add if op is _SUM else np.maximum if op is _MAX else np.minimum if op is _MIN
                 else np.multiply if op is _PROD else _UFUNC_BY_NAME.get(op) if op.__class__ is str else None)
        dtype = buf.dtype
        if ufunc is None or dtype not in DTYPE_IS_FLOAT:
            return False
        if engine.failure is not None or engine.closed or engine.interrupted is not None:
            return False
        for connection in connections:
            if not connection.quiet():
                return False
        # From here on this call runs the collective (True), or raises.
        context.seq = seq
        slot[0] = (seq << CODE_BITS) | started
        flat = buf if buf.ndim == 1 else buf.reshape(-1)
        view = byte_view(flat, False)
        begun = False
        for connection, lower_peer, label, bounce in rounds:
            send_step = connection.next_send_step(seq)
            recv_step = connection.next_recv_step(seq)
            header = connection.codec.data_header(seq, send_step, 0, nbytes, nbytes)
            expected = header if recv_step == send_step else connection.codec.data_header(seq, recv_step, 0,
                                                                                           nbytes, nbytes)
            sent = connection.send_frame_now(header, view)
            whole = sent == len(header) + nbytes
            arrived = 0
            if connection.parked:  # the engine read the header ahead: the payload follows it
                arrived = connection.read_parked_frame_now(expected, nbytes)
                engine.update_interest(connection)
            elif connection.header_have:  # it read part of a header ahead: it reads on
                arrived = -1
            elif whole:
                spin_until = 0.0
                polls = 0
                while True:
                    arrived = connection.read_frame_now(expected, nbytes)
                    if arrived:
                        break
                    polls += 1
                    if polls % per_yield == 0:
                        sched_yield()
                    if polls & 15 == 0:  # the clock every few polls: a poll costs less than a read of it
                        now = monotonic()
                        if not spin_until:
                            spin_until = now + FAST_SPIN_SECONDS
                        elif now > spin_until:
                            break
            if arrived == 1 and whole:
                other = bounce[connection.header_bytes:connection.header_bytes + nbytes].view(dtype)
            else:  # the engine finishes the round, and fails and explains as the general path does
                if not begun:
                    context.begin(collective, seq, "native", nbytes, timeout)
                    begun = True
                context.step = label
                other = transport.scratch(flat.size, dtype, SCRATCH_SLOT)
                if arrived == 1:  # only the send is left, and the engine may read into the bounce buffer
                    other[...] = bounce[connection.header_bytes:connection.header_bytes + nbytes].view(dtype)
                engine.resume_exchange(connection, None if whole else view, sent,
                                       None if arrived == 1 else byte_view(other, True), seq, send_step, recv_step,
                                       label)
            if lower_peer:  # the lower rank's operand first, as the general path combines them
                ufunc(other, flat, out=flat)
            else:
                ufunc(flat, other, out=flat)
        return True

    return allreduce

