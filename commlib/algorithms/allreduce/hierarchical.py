"""``hierarchical``: reduce-scatter inside each host, allreduce across hosts, allgather inside.

Terms. ``H`` hosts, host ``h`` with ``L_h`` ranks (uneven allowed), ``S = max L_h``. The
buffer is cut into ``S`` near-equal **shards**. On host ``h``, local rank ``l`` **owns** the
contiguous shards ``[l S / L_h, (l+1) S / L_h)`` (rounded down): one shard each on the largest
hosts, several for some ranks of smaller ones; a rank's shards form its **chunk**. The ranks
that own shard ``s``, one per host, form that shard's **cross group**.

1. Intra-host reduce-scatter (a ring over the host's ranks, chunks as above): each rank's
   chunk holds its host's sum.
2. Cross-host allreduce: every rank allreduces each shard it owns with the shard's cross group,
   all local ranks at once (as Horovod does), its shards in increasing order. Only this phase
   touches the network, and each shard crosses it once per direction per host for two hosts
   (``2(H-1)/H`` times with a ring among more).
3. Intra-host allgather (ring): every rank gets every chunk of its host.

Invariant: after phase 2 every owner of shard ``s`` holds the same bytes (the cross schedules
leave identical bytes in their group), so after phase 3 every rank of every host does too.
Shards may be empty (buffers smaller than ``S``): both sides skip them alike.

Cost (alpha-beta, two link classes: ``i`` inside a host, ``x`` across; ``K`` ranks on every
host, ``n`` bytes): ``2(K-1)(alpha_i + n/K beta_i)`` inside, plus the cross allreduce of
``n/K`` bytes among ``H`` ranks with all ``K`` of a host's ranks sharing its link:
``2(H-1)(alpha_x + n/H beta_x)`` (ring). The flat ring sends ``2(P-1)/P n`` across each host
boundary, the hierarchical ``2(H-1)/H n``: at ``2 x 2``, ``1.5 n`` against ``n``.

On a group whose hosts have mapped each other's memory (``transport.host_shared_memory``) and
have equal numbers of ranks, phases 1 and 3 read the host peers' memory directly (the
``shm_twoshot`` schedule, whose reduce-scatter slices are then the same element ranges on every
host) and phase 2 runs on each reduced slice in between, through the same cross groups: no
message inside a host at all. Uneven hosts keep the rings.

With ``pieces > 1`` (:func:`_pipelined`) the buffer is cut into pieces and the
phases of different pieces overlap: while piece ``k`` crosses the network on a helper thread,
the host reduce-scatters piece ``k + 1`` and allgathers piece ``k - 1``.
"""

from __future__ import annotations

import bisect
import threading
from typing import List, NamedTuple, Tuple

from commlib.algorithms.allreduce.rabenseifner import allreduce_rabenseifner
from commlib.algorithms.allreduce.recursive_doubling import allreduce_recursive_doubling
from commlib.algorithms.allreduce.ring import allreduce_ring
from commlib.algorithms.common.partition import Span, split_bounds
from commlib.algorithms.common.ring_phases import ring_allgather, ring_reduce_scatter
from commlib.algorithms.shm.twoshot import allreduce_shm_twoshot
from commlib.ops import ReduceOp
from commlib.transports.view import RankView

__all__ = ["allreduce_hierarchical", "ShardPlan", "shard_plan", "cross_algorithm"]

# Scratch slot ranges of the two views (their pipelines must not share receive buffers when
# the cross phase runs on its own thread).
INTRA_SCRATCH_BASE = 100
CROSS_SCRATCH_BASE = 200
# Pieces of a pipelined run are at least this big: below, a piece's steps cost more in latency
# than the overlap saves.
MIN_PIECE_BYTES = 1 << 20
PIECES = 4
# What cross_algorithm may name: the cross-host phase runs these schedules directly (a user's
# registration under one of the names does not change what hierarchical composes).
CROSS_ALGORITHMS = {"ring": allreduce_ring, "rabenseifner": allreduce_rabenseifner,
                    "recursive_doubling": allreduce_recursive_doubling}


class ShardPlan(NamedTuple):
    """Who owns what, computed alike on every rank from the topology and the buffer's length."""

    shards: List[Span]                      # S spans of the flat buffer
    first_shard: Tuple[Tuple[int, ...], ...]  # per host: local rank l owns [first[l], first[l+1])
    host_ranks: Tuple[Tuple[int, ...], ...]

    def chunks(self, host: int) -> List[Span]:
        """The chunk (span of the buffer) of each local rank of ``host``."""
        first = self.first_shard[host]
        return [(self.shards[first[local]][0], self.shards[first[local + 1] - 1][1]) for local in range(len(first) - 1)]

    def owned_shards(self, host: int, local_rank: int) -> range:
        first = self.first_shard[host]
        return range(first[local_rank], first[local_rank + 1])

    def owner(self, host: int, shard: int) -> int:
        """The rank of ``host`` that owns ``shard``."""
        local = bisect.bisect_right(self.first_shard[host], shard) - 1
        return self.host_ranks[host][local]

    def cross_group(self, shard: int) -> List[int]:
        return [self.owner(host, shard) for host in range(len(self.host_ranks))]


def shard_plan(topology, start: int, stop: int) -> ShardPlan:
    shard_count = max(topology.ranks_per_host)
    first = tuple(tuple(local * shard_count // len(ranks) for local in range(len(ranks) + 1))
                  for ranks in topology.host_ranks)
    return ShardPlan(split_bounds(start, stop, shard_count), first, topology.host_ranks)


def cross_algorithm(hosts: int, shard_bytes: int) -> str:
    """The schedule of the cross-host phase among ``hosts`` ranks, one per host.

    Two hosts: recursive doubling (one whole-shard exchange moves the same bytes as the ring's
    two half-shard steps, in one latency). More: recursive doubling for small shards, else the
    bandwidth-optimal rabenseifner (powers of two) or ring.
    """
    if hosts == 2 or shard_bytes <= 64 << 10:
        return "recursive_doubling"
    return "rabenseifner" if hosts & (hosts - 1) == 0 else "ring"


def allreduce_hierarchical(transport, buf, op: ReduceOp, *, segment_bytes: int = 1 << 20,
                           pieces: int = PIECES) -> None:
    if transport.size == 1 or buf.size == 0:
        return
    topology = transport.topology
    host = topology.host_index
    intra = RankView(transport, topology.host_ranks[host], scratch_base=INTRA_SCRATCH_BASE,
                     label="hierarchical intra-host")
    pieces = max(1, min(pieces, buf.nbytes // MIN_PIECE_BYTES))
    if not getattr(transport, "concurrent_posts", False):
        pieces = 1  # NCCL: one order of calls per communicator on every rank, so no helper thread
    shared_memory = transport.host_shared_memory
    if (shared_memory is not None and topology.spans_hosts and topology.uniform and shared_memory.size > 1
            and list(shared_memory.ranks) == list(topology.host_ranks[host])):
        _with_shared_memory(transport, shared_memory, buf, op, segment_bytes)
        return
    if pieces == 1 or not topology.spans_hosts:
        plan = shard_plan(topology, 0, buf.size)
        _reduce_scatter_in_host(intra, buf, op, plan, host, segment_bytes)
        _allreduce_across_hosts(transport, buf, op, plan, segment_bytes)
        _allgather_in_host(intra, buf, plan, host)
        return
    _pipelined(transport, intra, buf, op, host, segment_bytes, pieces)


def _reduce_scatter_in_host(intra, buf, op, plan: ShardPlan, host: int, segment_bytes: int) -> None:
    ring_reduce_scatter(intra, buf, op, plan.chunks(host), segment_bytes=segment_bytes,
                        label="reduce-scatter")


def _allgather_in_host(intra, buf, plan: ShardPlan, host: int) -> None:
    ring_allgather(intra, buf, plan.chunks(host), label="allgather")


def _allreduce_across_hosts(transport, buf, op, plan: ShardPlan, segment_bytes: int) -> None:
    topology = transport.topology
    if not topology.spans_hosts:
        return
    hosts = topology.host_count
    for shard in plan.owned_shards(topology.host_index, topology.local_rank):
        lo, hi = plan.shards[shard]
        if hi == lo:
            continue
        name = cross_algorithm(hosts, (hi - lo) * buf.itemsize)
        cross = RankView(transport, plan.cross_group(shard), scratch_base=CROSS_SCRATCH_BASE,
                         label=f"hierarchical cross-host allreduce of shard {shard} ({name})")
        CROSS_ALGORITHMS[name](cross, buf[lo:hi], op, segment_bytes=segment_bytes)


def _with_shared_memory(transport, shared_memory, buf, op, segment_bytes: int) -> None:
    """Phases 1 and 3 in shared memory; phase 2 on each slice this rank reduced, with the ranks
    of the same local rank on the other hosts (equal hosts: they hold the same element range)."""

    topology = transport.topology
    hosts = topology.host_count
    cross = RankView(transport, [ranks[topology.local_rank] for ranks in topology.host_ranks],
                     scratch_base=CROSS_SCRATCH_BASE, label="hierarchical cross-host allreduce (shared memory inside)")

    def across_hosts(reduced_slice) -> None:
        name = cross_algorithm(hosts, reduced_slice.nbytes)
        CROSS_ALGORITHMS[name](cross, reduced_slice, op, segment_bytes=segment_bytes)

    allreduce_shm_twoshot(shared_memory, buf, op, segment_bytes=segment_bytes, slice_hook=across_hosts)


def _pipelined(transport, intra, buf, op, host: int, segment_bytes: int, pieces: int) -> None:
    """Pieces flow through the three phases; the cross phase runs on a helper thread.

    The main thread works off one fixed order on every rank: reduce-scatter piece 0, then for
    each ``k >= 1`` reduce-scatter piece ``k`` and allgather piece ``k - 1`` (waiting until the
    helper has crossed it), then allgather the last piece. A fixed order matters: the host's
    ranks talk to the same ring neighbours in both intra phases, and MPI matches one pair's
    messages in posting order. The helper crosses pieces in order as they become ready. The two
    threads never talk to the same pair of ranks (intra: same host; cross: different hosts).
    While piece ``k`` crosses, the host reduce-scatters ``k + 1`` and allgathers ``k - 1``.
    """
    topology = transport.topology
    plans = [shard_plan(topology, lo, hi) for lo, hi in split_bounds(0, buf.size, pieces)]
    ready = [threading.Event() for _ in plans]
    crossed = [threading.Event() for _ in plans]
    failure: List[BaseException] = []

    def cross_in_order() -> None:
        try:
            for index, plan in enumerate(plans):
                ready[index].wait()
                if failure:
                    return
                _allreduce_across_hosts(transport, buf, op, plan, segment_bytes)
                crossed[index].set()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            failure.append(exc)
        finally:
            for event in crossed:
                event.set()

    def allgather_when_crossed(index: int) -> None:
        crossed[index].wait()
        if failure:
            raise failure[0]
        _allgather_in_host(intra, buf, plans[index], host)

    helper = threading.Thread(target=cross_in_order, name="commlib-hierarchical-cross", daemon=True)
    helper.start()
    try:
        for index, plan in enumerate(plans):
            _reduce_scatter_in_host(intra, buf, op, plan, host, segment_bytes)
            ready[index].set()
            if index >= 1:
                allgather_when_crossed(index - 1)
        allgather_when_crossed(len(plans) - 1)
    except BaseException as exc:
        if not failure:
            failure.append(exc)
        for event in ready:
            event.set()  # the helper stops at its next piece
        raise
    finally:
        helper.join()
