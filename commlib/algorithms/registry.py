"""The algorithm registry: adding an algorithm is adding a file and a line.

Every collective has its own table of algorithms, ``"native"`` (the transport library's own:
``MPI_Bcast``, ``ncclAllGather``, ...) among them. An algorithm is a function written against the
:class:`commlib.transports.interface.Transport` it is given, and nothing else (no mpi4py, no cupy: the array
module is ``transport.xp``). Buffers are flat, C-contiguous 1-D arrays of one dtype; sizes are in
elements. Every algorithm must work at every world size 1..N and every size (0 and sizes below
the world size included), and take ``segment_bytes`` (the pipeline knob) as a keyword even if it
ignores it. The calling convention of each collective:

``allreduce``: ``fn(transport, buf, op, *, segment_bytes)``
    Reduce ``buf`` in place across ranks with ``op``; every rank ends with the same bytes.
``broadcast``: ``fn(transport, buf, root, *, segment_bytes)``
    In place: ``root``'s ``buf`` is the input and is not written; every other rank's ``buf`` is
    overwritten with it.
``reduce``: ``fn(transport, buf, root, op, *, segment_bytes)``
    ``root``'s ``buf`` becomes the reduction over all ranks' ``buf``. Every other rank's ``buf``
    is input only and must be left exactly as it was (work in ``transport.scratch``).
``allgather``: ``fn(transport, out, inp, *, segment_bytes)``
    ``out.size == size * inp.size``; rank ``r``'s ``inp`` lands in block ``r`` of every rank's
    ``out`` (rank-major). ``inp`` is read only; ``out`` and ``inp`` do not overlap.
``reduce_scatter``: ``fn(transport, out, inp, op, *, segment_bytes)``
    ``inp.size == size * out.size``; rank ``r``'s ``out`` becomes block ``r`` of the reduction of
    every rank's ``inp``. ``inp`` is read only.
``alltoall``: ``fn(transport, out, inp, *, segment_bytes)``
    Equal blocks: ``inp.size == out.size == size * block``; block ``j`` of rank ``i``'s ``inp``
    lands in block ``i`` of rank ``j``'s ``out``. ``inp`` is read only.
``alltoallv``: ``fn(transport, out, inp, out_counts, in_counts, *, segment_bytes)``
    ``in_counts[j]`` elements go to rank ``j``, taken from ``inp`` in rank order (displacements
    are the prefix sums); ``out_counts[i]`` elements arrive from rank ``i`` into ``out`` in rank
    order. Counts are tuples of ints that the group has already checked against each other
    (rank ``i``'s ``in_counts[j]`` equals rank ``j``'s ``out_counts[i]``).
``gather``: ``fn(transport, out, inp, root, *, segment_bytes)``
    Like allgather, but only ``root`` gets ``out`` (``size * inp.size``); ``out`` is ``None``
    on the other ranks.
``scatter``: ``fn(transport, out, inp, root, *, segment_bytes)``
    ``root``'s ``inp`` (``size * out.size``) is cut into blocks; rank ``r`` gets block ``r`` in
    ``out``. ``inp`` is ``None`` on the other ranks.
``barrier``: ``fn(transport, *, segment_bytes)``
    Returns on a rank only after every rank has entered.

``ReduceOp.AVG`` never reaches an algorithm (the group runs SUM and divides once) unless the
function says ``folds_average = True`` (it divides while the data is in cache). A
function with ``requires_shared_memory = True`` (allreduce's ``shm_*``, the data movers'
``shm_direct``) reads its peers' memory: the group hands it its shared-memory transport, and only
on a group within one host. Register one
from anywhere (a research script, a plugin)::

    from commlib.algorithms import register_algorithm
    register_algorithm("my_allgather", my_allgather, collective="allgather")
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Dict, List, Mapping

from commlib.errors import InvalidUsageError

__all__ = ["register_algorithm", "unregister_algorithm", "get_algorithm", "algorithm_names", "algorithm_table",
           "COLLECTIVES", "AlgorithmFn", "AllreduceFn"]

AlgorithmFn = Callable[..., None]
AllreduceFn = AlgorithmFn
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
               "alltoallv", "gather", "scatter", "barrier")
_REGISTRIES: Dict[str, Dict[str, AlgorithmFn]] = {collective: {} for collective in COLLECTIVES}
RESERVED_NAMES = ("auto",)


def _table(collective: str) -> Dict[str, AlgorithmFn]:
    try:
        return _REGISTRIES[collective]
    except (KeyError, TypeError):
        raise InvalidUsageError(f"unknown collective {collective!r}: expected one of "
                                f"{', '.join(COLLECTIVES)}") from None


def register_algorithm(name: str, fn: AlgorithmFn, collective: str = "allreduce", *,
                       replace: bool = False) -> AlgorithmFn:
    table = _table(collective)
    if not isinstance(name, str) or not name.isidentifier():
        raise InvalidUsageError(f"algorithm name {name!r}: expected a Python identifier")
    if name in RESERVED_NAMES:
        raise InvalidUsageError(f"algorithm name {name!r} is reserved")
    if not callable(fn):
        raise InvalidUsageError(f"algorithm {name!r}: expected a callable, got {type(fn).__name__}")
    if name in table and not replace and table[name] is not fn:
        raise InvalidUsageError(f"{collective} algorithm {name!r} is already registered (pass replace=True)")
    table[name] = fn
    return fn


def get_algorithm(name: str, collective: str = "allreduce") -> AlgorithmFn:
    table = _table(collective)
    try:
        return table[name]
    except (KeyError, TypeError):
        raise InvalidUsageError(
            f"unknown {collective} algorithm {name!r}: expected one of "
            f"{', '.join(['auto'] + algorithm_names(collective))}"
        ) from None


def algorithm_names(collective: str = "allreduce") -> List[str]:
    return sorted(_table(collective))


def algorithm_table(collective: str = "allreduce") -> Mapping[str, AlgorithmFn]:
    """``collective``'s algorithms by name, read-only and live (later registrations show), for
    ``auto``'s choices, which may only pick what is registered."""
    return MappingProxyType(_table(collective))


def unregister_algorithm(name: str, collective: str = "allreduce") -> None:
    """Remove an algorithm registered with :func:`register_algorithm` (a test's or a plugin's)."""
    table = _table(collective)
    if name not in table:
        raise InvalidUsageError(f"{collective} algorithm {name!r} is not registered")
    del table[name]


def _register_builtins() -> None:
    # Each schedule is written against the transport interface only; "native" hands the call to
    # the transport's library. Imported here, not at the top: an algorithm module may import
    # this one (for its types), never the other way round at import time.
    from commlib.algorithms import native
    from commlib.algorithms.allgather.bruck import allgather_bruck
    from commlib.algorithms.allgather.recursive_doubling import allgather_recursive_doubling
    from commlib.algorithms.allgather.ring import allgather_ring
    from commlib.algorithms.allreduce.hierarchical import allreduce_hierarchical
    from commlib.algorithms.allreduce.rabenseifner import allreduce_rabenseifner
    from commlib.algorithms.allreduce.recursive_doubling import allreduce_recursive_doubling
    from commlib.algorithms.allreduce.ring import allreduce_ring
    from commlib.algorithms.allreduce.tree import allreduce_tree
    from commlib.algorithms.alltoall.bruck import alltoall_bruck
    from commlib.algorithms.alltoall.pairwise import alltoall_pairwise, alltoallv_pairwise
    from commlib.algorithms.alltoall.scattered import alltoall_scattered, alltoallv_scattered
    from commlib.algorithms.barrier.dissemination import barrier_dissemination
    from commlib.algorithms.broadcast.binomial import broadcast_binomial
    from commlib.algorithms.broadcast.chain import broadcast_chain
    from commlib.algorithms.broadcast.flat import broadcast_flat
    from commlib.algorithms.broadcast.scatter_allgather import broadcast_scatter_allgather
    from commlib.algorithms.gather.binomial import gather_binomial
    from commlib.algorithms.reduce.binomial import reduce_binomial
    from commlib.algorithms.reduce.rabenseifner import reduce_rabenseifner
    from commlib.algorithms.reduce_scatter.pairwise import reduce_scatter_pairwise
    from commlib.algorithms.reduce_scatter.recursive_halving import reduce_scatter_recursive_halving
    from commlib.algorithms.reduce_scatter.ring import reduce_scatter_ring
    from commlib.algorithms.scatter.binomial import scatter_binomial
    from commlib.algorithms.shm.direct import (allgather_shm_direct, alltoall_shm_direct, broadcast_shm_direct,
                                               gather_shm_direct, scatter_shm_direct)
    from commlib.algorithms.shm.oneshot import allreduce_shm_oneshot
    from commlib.algorithms.shm.twoshot import allreduce_shm_twoshot

    for collective in COLLECTIVES:
        register_algorithm("native", getattr(native, f"{collective}_native"), collective)
    builtins: Dict[str, Dict[str, AlgorithmFn]] = {
        "allreduce": {"ring": allreduce_ring, "tree": allreduce_tree,
                      "recursive_doubling": allreduce_recursive_doubling, "rabenseifner": allreduce_rabenseifner,
                      "hierarchical": allreduce_hierarchical,
                      # direct reads of the peers' memory on one host (a shared-memory transport)
                      "shm_oneshot": allreduce_shm_oneshot, "shm_twoshot": allreduce_shm_twoshot},
        "broadcast": {"binomial": broadcast_binomial, "chain": broadcast_chain, "flat": broadcast_flat,
                      "scatter_allgather": broadcast_scatter_allgather, "shm_direct": broadcast_shm_direct},
        "reduce": {"binomial": reduce_binomial, "rabenseifner": reduce_rabenseifner},
        "allgather": {"ring": allgather_ring, "recursive_doubling": allgather_recursive_doubling,
                      "bruck": allgather_bruck, "shm_direct": allgather_shm_direct},
        "reduce_scatter": {"ring": reduce_scatter_ring, "recursive_halving": reduce_scatter_recursive_halving,
                           "pairwise": reduce_scatter_pairwise},
        "alltoall": {"pairwise": alltoall_pairwise, "bruck": alltoall_bruck, "scattered": alltoall_scattered,
                     "shm_direct": alltoall_shm_direct},
        "alltoallv": {"pairwise": alltoallv_pairwise, "scattered": alltoallv_scattered},
        "gather": {"binomial": gather_binomial, "shm_direct": gather_shm_direct},
        "scatter": {"binomial": scatter_binomial, "shm_direct": scatter_shm_direct},
        "barrier": {"dissemination": barrier_dissemination},
    }
    for collective, table in builtins.items():
        for name, fn in table.items():
            register_algorithm(name, fn, collective)


_register_builtins()
