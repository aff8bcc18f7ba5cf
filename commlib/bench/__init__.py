"""``python -m commlib.bench``: collective benchmarks in the manner of nccl-tests.

One harness, one small spec per collective (nccl-tests' ``struct testColl``):

* :mod:`.harness` - the command line and the loop over sizes, written once for every collective;
* :mod:`.specs` - per collective: bytes per row, bus factor, inputs with a closed-form result, check, call;
* :mod:`.values` - the rank-derived inputs, their closed forms and the MPI types for the baseline;
* :mod:`.rows` - the kinds of row on one size (baseline, algorithms, symmetric buffers, the floor);
* :mod:`.timing` - contenders in turn, medians of the slowest rank (shared with the torch benchmarks);
* :mod:`.floor` - the two-shot allreduce's memory work alone (``--floor``);
* :mod:`.barrier_check` - the barrier's #wrong: an arrival board in shared memory;
* :mod:`.table`, :mod:`.record` - the printed table and ``--json`` (one format for every benchmark).
"""
