"""What the tests share (imported as ``tests.support.*``; run_mpi puts the repository root on the
ranks' path):

* :mod:`.mpirun`: ``run_mpi`` (one script under mpiexec, with a hard timeout) and ``Job``/``Part``
  (several scripts in one job, :mod:`.job`, each with its own verdict);
* :mod:`.verdict`: ``Checker``, checks gathered across ranks (fail on every rank, or none);
* :mod:`.closed_form`: rank-derived inputs and the results they must give;
* :mod:`.multihost`: clusters of network-namespace hosts, and jobs on them;
* :mod:`.line_buffered`: every process the tests start writes whole lines;
* :mod:`.check_log`: the session's count of the rank scripts' checks;
* the rest: fault causes, GPU presence and the stand-in for CuPy, MPICH's leftover segments,
  helpers of particular rank scripts (fast path, gloo comparisons, the low-communication
  methods' single-process references), a TCP rate probe.
"""
