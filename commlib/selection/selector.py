"""``AlgorithmSelector``: which algorithm one call of a group runs, ``"auto"`` resolved.

The order of the rules, first that applies wins:

1. an override (``COMMLIB_ALGO``, ``COMMLIB_ALGO_<COLLECTIVE>``);
2. GPU buffers: the library's own (NCCL's collectives beat a Python schedule over NCCL
   send/recv);
3. an allreduce of a group that spans hosts: the across-hosts table, or a fitted cost model
   (:mod:`.across_hosts`, :mod:`.cost_model`);
4. a group within one host with shared memory: the shared-memory schedules where they win
   (:func:`.auto.choose_shared_memory_allreduce`, :func:`.auto.choose_shared_memory_mover`);
   where those tables leave an allreduce to the schedules over point-to-point messages (plain
   buffers of many MiB: MPI's messages between ranks of a host move through shared memory too,
   and ring wins there), and the transport's messages do not (loopback sockets, under torchrun),
   ``shm_twoshot`` (measured: docs/benchmarks/launch-torchrun-allreduce-p2);
5. the size table of the collective (:func:`.auto.choose`).

Only registered algorithms are ever picked (a table naming one that is not falls back to
``"native"``).
"""

from __future__ import annotations

from typing import Optional

from commlib.algorithms.registry import algorithm_table
from commlib.errors import InvalidUsageError
from commlib.selection.across_hosts import choose_across_hosts
from commlib.selection.auto import choose, choose_shared_memory_allreduce, choose_shared_memory_mover
from commlib.selection.cost_model import CostModel

__all__ = ["AlgorithmSelector", "load_cost_model"]


def load_cost_model(path: Optional[str]) -> Optional[CostModel]:
    """The model ``COMMLIB_COST_MODEL`` names (read once per group that spans hosts), or None."""
    return CostModel.load(path) if path else None


class AlgorithmSelector:
    """The rules above for one group: its size and topology, its config's overrides, whether it
    has a shared-memory transport (and cross-memory attach), and its cost model."""

    def __init__(self, size: int, topology, config, *, shared_memory: bool, cross_memory: bool,
                 cost_model: Optional[CostModel] = None, messages_in_shared_memory: bool = True):
        self.size = size
        self.topology = topology
        self.config = config
        self.shared_memory = shared_memory
        self.cross_memory = cross_memory
        self.cost_model = cost_model
        #: The transport's messages between ranks of one host move through shared memory (rule 4).
        self.messages_in_shared_memory = messages_in_shared_memory

    def resolve(self, algorithm: str, nbytes: int, on_gpu: bool = False, collective: str = "allreduce",
                symmetric: bool = False) -> str:
        """The algorithm a ``collective`` call with ``algorithm`` and ``nbytes`` runs; ``symmetric``:
        every buffer of the call lives in the group's shared memory (``alloc``)."""
        if algorithm == "auto":
            override = self.config.algorithm_override_for(collective)
            if override:
                return override
            if on_gpu:
                return "native"
            if collective == "allreduce" and self.topology.spans_hosts:
                return choose_across_hosts(nbytes, self.topology, algorithm_table("allreduce"), self.cost_model)
            if self.shared_memory:
                shared = (choose_shared_memory_allreduce(nbytes, self.size, symmetric) if collective == "allreduce"
                          else choose_shared_memory_mover(collective, nbytes, self.size, self.cross_memory,
                                                          symmetric))
                if shared is not None:
                    return shared
                if collective == "allreduce" and not self.messages_in_shared_memory and self.size > 1:
                    return "shm_twoshot"
            return choose(collective, nbytes, self.size, algorithm_table(collective))
        if algorithm.__class__ is not str:
            raise InvalidUsageError(f"{collective}: algorithm must be a str, got {algorithm!r}")
        return algorithm
