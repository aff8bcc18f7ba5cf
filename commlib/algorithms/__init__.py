"""The algorithms of every collective, one file each, and the registry that names them.

Layout: one folder per collective (``allreduce/``, ``broadcast/``, ``reduce/``, ``allgather/``,
``reduce_scatter/``, ``alltoall/``, ``gather/``, ``scatter/``, ``barrier/``), ``shm/`` for the
schedules that read the peers' memory on one host, ``common/`` for the parts several schedules
share, ``native.py`` for the transport library's own collectives, and :mod:`.registry` (the
calling convention of each collective, and how to add an algorithm).
"""

from commlib.algorithms.registry import (COLLECTIVES, AlgorithmFn, AllreduceFn, algorithm_names, algorithm_table,
                                         get_algorithm, register_algorithm, unregister_algorithm)

__all__ = ["register_algorithm", "get_algorithm", "algorithm_names", "algorithm_table", "unregister_algorithm",
           "COLLECTIVES", "AlgorithmFn", "AllreduceFn"]
