"""The socket transport's own collectives (the ``"native"`` algorithms), on its point-to-point posts.

They are schedules like those of ``commlib/algorithms``, written again here because a transport
imports nothing above it; each is the textbook choice for a TCP mesh (gloo's), in the alpha-beta
model with ``p`` ranks, ``n`` bytes:

* allreduce: recursive doubling up to :data:`SMALL_BYTES` (``log2 p`` rounds of ``n``; a
  non-power-of-two folds its extra ranks into partners first); above, the ring: a
  reduce-scatter then an allgather, ``2(p-1)`` steps of ``n/p`` (each rank's *chunk*), each
  step cut into *segments* of ``segment_bytes`` so that a segment is reduced while the next
  ones stream, and forwarded as soon as it is;
* broadcast: a binomial tree (``log2 p`` levels), segments forwarded as they arrive;
* reduce: a binomial tree towards the root; the others' buffers are left as they were;
* allgather, reduce_scatter: the ring, ``p-1`` steps of one block;
* barrier: dissemination, ``ceil(log2 p)`` rounds of empty messages (a frame header each).

Every rank ends an allreduce with the same bytes: each pair combines the lower rank's operand
first, and each ring chunk is reduced once along one path, then copied.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from commlib.ops import ReduceOp
from commlib.transports.interface import Transport

__all__ = ["SocketNativeCollectives", "SMALL_BYTES", "partition"]

SMALL_BYTES = 256 << 10
_SLOT_A, _SLOT_B = 1 << 20, (1 << 20) + 1  # scratch slots of their own, far from the schedules'


def partition(count: int, parts: int) -> List[int]:
    """Offsets of ``parts`` near-equal pieces of ``count`` (the first ``count % parts`` one longer)."""
    base, extra = divmod(count, parts)
    offsets = [0]
    for index in range(parts):
        offsets.append(offsets[-1] + base + (index < extra))
    return offsets


def _binomial(relative: int, size: int) -> Tuple[int, List[int]]:
    """(parent, children) of ``relative`` in the binomial tree rooted at 0; largest subtree first."""
    parent = relative & (relative - 1) if relative else -1
    lowest = relative & -relative if relative else 1 << size.bit_length()
    children = []
    distance = 1
    while distance < lowest and relative + distance < size:
        children.append(relative + distance)
        distance <<= 1
    return parent, children[::-1]


class SocketNativeCollectives(Transport):
    """The base of :class:`commlib.transports.socket.SocketTransport` (uses only ``post`` and
    local work)."""

    #: The pipeline segment of the ring and the broadcast.
    segment_bytes: int = 1 << 20

    # -- allreduce ---------------------------------------------------------------------------
    def native_allreduce(self, buf, op: ReduceOp) -> None:
        flat = buf.reshape(-1)
        if self.size == 1 or flat.size == 0:
            return
        if flat.nbytes <= SMALL_BYTES or flat.size < self.size:
            self._allreduce_recursive_doubling(flat, op)
        else:
            self._allreduce_ring(flat, op)

    def _allreduce_recursive_doubling(self, flat, op: ReduceOp) -> None:
        rank, size = self.rank, self.size
        power = 1 << (size.bit_length() - 1)
        extra = size - power
        other = self.scratch(flat.size, flat.dtype, _SLOT_A)
        virtual = rank - extra
        if rank < 2 * extra:
            self.step("native allreduce: fold")
            if rank % 2 == 0:
                self.send(flat, rank + 1)
                virtual = -1
            else:
                self.recv(other, rank - 1)
                self.reduce(flat, other, op, src_first=True)
                virtual = rank // 2
        if virtual >= 0:
            mask = 1
            while mask < power:
                partner_virtual = virtual ^ mask
                partner = 2 * partner_virtual + 1 if partner_virtual < extra else partner_virtual + extra
                self.step(f"native allreduce: round {mask.bit_length() - 1}")
                self.sendrecv(flat, partner, other, partner)
                self.reduce(flat, other, op, src_first=partner_virtual < virtual)
                mask <<= 1
        if rank < 2 * extra:
            self.step("native allreduce: unfold")
            if rank % 2 == 0:
                self.recv(flat, rank + 1)
            else:
                self.send(flat, rank - 1)

    def _allreduce_ring(self, flat, op: ReduceOp) -> None:
        rank, size = self.rank, self.size
        left, right = (rank - 1) % size, (rank + 1) % size
        chunks = partition(flat.size, size)
        longest = chunks[1] - chunks[0]
        segments = max(1, -(-longest * flat.itemsize // self.segment_bytes))
        # Segment k of any chunk fits segment k of the longest one: the scratch is one chunk.
        room = partition(longest, segments)
        incoming = self.scratch(longest, flat.dtype, _SLOT_A)

        def piece(chunk: int, k: int):
            offsets = partition(chunks[chunk + 1] - chunks[chunk], segments)
            return chunks[chunk] + offsets[k], chunks[chunk] + offsets[k + 1]

        def post_send(chunk: int, k: int, sent: list) -> None:
            lo, hi = piece(chunk, k)
            if hi > lo:
                sent.append(self.post(sends=((flat[lo:hi], right),)))

        def post_recv(chunk: int, k: int, into_scratch: bool):
            lo, hi = piece(chunk, k)
            if hi == lo:
                return None
            target = incoming[room[k]:room[k] + hi - lo] if into_scratch else flat[lo:hi]
            return self.post(recvs=((target, left),))

        sent: list = []
        self.step("native allreduce: ring reduce-scatter")
        for k in range(segments):
            post_send(rank, k, sent)
        waiting = [post_recv(left, k, True) for k in range(segments)]
        for step in range(size - 1):
            chunk = (rank - step - 1) % size
            for k in range(segments):
                if waiting[k] is None:
                    continue
                waiting[k].wait()
                lo, hi = piece(chunk, k)
                self.reduce(flat[lo:hi], incoming[room[k]:room[k] + hi - lo], op, src_first=True)
                if step + 1 < size - 1:
                    post_send(chunk, k, sent)
                    waiting[k] = post_recv((chunk - 1) % size, k, True)
        self.step("native allreduce: ring allgather")
        for k in range(segments):
            post_send((rank + 1) % size, k, sent)
        waiting = [post_recv(rank, k, False) for k in range(segments)]
        for step in range(size - 1):
            chunk = (rank - step) % size
            for k in range(segments):
                if waiting[k] is None:
                    continue
                waiting[k].wait()
                if step + 1 < size - 1:
                    post_send(chunk, k, sent)
                    waiting[k] = post_recv((chunk - 1) % size, k, False)
        for pending in sent:
            pending.wait()

    # -- broadcast and reduce ----------------------------------------------------------------
    def native_broadcast(self, buf, root: int) -> None:
        flat = buf.reshape(-1)
        if self.size == 1 or flat.size == 0:
            return
        size = self.size
        relative = (self.rank - root) % size
        parent, children = _binomial(relative, size)
        step = max(1, self.segment_bytes // flat.itemsize)
        bounds = list(range(0, flat.size, step)) + [flat.size]
        self.step("native broadcast: binomial")
        arriving = ([self.post(recvs=((flat[lo:hi], (parent + root) % size),))
                     for lo, hi in zip(bounds[:-1], bounds[1:])] if parent >= 0 else [])
        sent = []
        for index, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if arriving:
                arriving[index].wait()
            if children:
                sent.append(self.post(sends=[(flat[lo:hi], (child + root) % size)
                                             for child in children]))
        for pending in sent:
            pending.wait()

    def native_reduce(self, buf, root: int, op: ReduceOp) -> None:
        flat = buf.reshape(-1)
        if self.size == 1 or flat.size == 0:
            return
        size = self.size
        relative = (self.rank - root) % size
        parent, children = _binomial(relative, size)
        self.step("native reduce: binomial")
        if not children:
            self.send(flat, (parent + root) % size)
            return
        if relative == 0:
            total = flat
        else:  # the caller's buffer is input only
            total = self.scratch(flat.size, flat.dtype, _SLOT_A)
            self.copy(total, flat)
        other = self.scratch(flat.size, flat.dtype, _SLOT_B)
        for child in reversed(children):  # nearest first: it finishes its subtree first
            self.recv(other, (child + root) % size)
            self.reduce(total, other, op)
        if relative:
            self.send(total, (parent + root) % size)

    # -- allgather and reduce-scatter --------------------------------------------------------
    def native_allgather(self, out, inp) -> None:
        block, rank, size = inp.size, self.rank, self.size
        out = out.reshape(-1)
        self.copy(out[rank * block:(rank + 1) * block], inp.reshape(-1))
        if size == 1 or block == 0:
            return
        left, right = (rank - 1) % size, (rank + 1) % size
        for step in range(size - 1):
            sending, arriving = (rank - step) % size, (rank - step - 1) % size
            self.step(f"native allgather: ring step {step}")
            self.exchange(sends=((out[sending * block:(sending + 1) * block], right),),
                          recvs=((out[arriving * block:(arriving + 1) * block], left),))

    def native_reduce_scatter(self, out, inp, op: ReduceOp) -> None:
        block, rank, size = out.size, self.rank, self.size
        out, inp = out.reshape(-1), inp.reshape(-1)
        if size == 1:
            self.copy(out, inp)
            return
        if block == 0:
            return
        left, right = (rank - 1) % size, (rank + 1) % size
        partial = self.scratch(block, out.dtype, _SLOT_A)
        other = self.scratch(block, out.dtype, _SLOT_B)

        def own(index: int):
            return inp[index * block:(index + 1) * block]

        for step in range(size - 1):
            # Step s receives the partial of block (rank + p - 2 - s): the last is block rank.
            arriving = (rank + size - 2 - step) % size
            self.step(f"native reduce_scatter: ring step {step}")
            self.exchange(sends=((own((rank - 1) % size) if step == 0 else partial, right),),
                          recvs=((other, left),))
            target = out if step == size - 2 else partial
            self.copy(target, own(arriving))
            self.reduce(target, other, op, src_first=True)

    def native_barrier(self) -> None:
        rank, size = self.rank, self.size
        token, arrived = np.empty(0, np.uint8), np.empty(0, np.uint8)
        distance = 1
        while distance < size:
            self.step(f"native barrier: round {distance.bit_length() - 1}")
            self.exchange(sends=((token, (rank + distance) % size),),
                          recvs=((arrived, (rank - distance) % size),))
            distance <<= 1
