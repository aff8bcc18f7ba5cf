"""Transports: how bytes move between ranks, beside the interface they all implement.

* ``interface.py``: :class:`Transport` (what algorithms and the group may use), ``Pending``,
  ``CollectiveContext``;
* ``mpi.py`` (with ``mpi_natives.py``, the library's collectives, ``mpi_inline.py``, their
  small-message fast path, ``mpi_types.py`` and ``polling.py``): MPI on CPU;
* ``nccl.py`` and ``host_staged.py``: GPU buffers over NCCL, or staged through host memory over
  MPI (CuPy is imported only by the code that runs on a GPU);
* ``shm.py``: the ranks of one host through shared memory;
* ``view.py``: a subset of another transport's ranks, renumbered (hierarchical's phases);
* ``inprocess.py``: ranks as threads of one process, for schedule tests.
"""
