"""Transports: how bytes move between ranks, beside the interface they all implement.

* ``interface.py``: :class:`Transport` (what algorithms and the group may use), ``Pending``,
  ``CollectiveContext``;
* ``mpi/``: MPI on CPU (``transport.py``; ``natives.py``, the library's collectives;
  ``fast_path.py``, their small-message fast path; ``types.py``, dtypes and ops);
* ``nccl.py`` and ``host_staged.py``: GPU buffers over NCCL, or staged through host memory over
  MPI (CuPy is imported only by the code that runs on a GPU);
* ``shm/``: the ranks of one host through shared memory;
* ``view.py``: a subset of another transport's ranks, renumbered (hierarchical's phases);
* ``inprocess.py``: ranks as threads of one process, for schedule tests.

A transport imports nothing above it: only :mod:`commlib.errors`, :mod:`commlib.ops`,
:mod:`commlib.topology`, :mod:`commlib.platform`, :mod:`commlib.shm` and
:mod:`commlib.reliability` (the progress board its waits read).
"""
