"""torch's own distributed test suite (``DistributedTest``), runnable against the "commlib" backend.

torch's ``test/distributed/test_distributed_spawn.py`` builds ``TestDistBackendWithSpawn`` from
``TestDistBackend`` (it starts one process per rank for every test, each running
``dist.init_process_group(BACKEND, init_method="file://...")``) and
``DistributedTest._DistTestBase`` (the tests). This module builds the same class, and for
``BACKEND=commlib`` gives commlib gloo's place in the harness's backend tables, without touching
torch's files:

- the harness decides most skips in decorators, evaluated once, when
  ``torch.testing._internal.distributed.distributed_test`` is imported, from the module global
  ``BACKEND`` (``BACKEND != "gloo"``, ``BACKEND in DistTestCases.backend_feature["ddp"]``, ...):
  it is imported with ``BACKEND=gloo`` in the environment, then its global is set to
  ``"commlib"``, which is what the ranks hand ``init_process_group`` and what the test bodies see;
- the tables the test bodies read at run time (``DistTestCases.backend_feature``, the profiling
  allow-lists) get "commlib" wherever they hold "gloo";
- a few test bodies branch on the global at run time (``if BACKEND == "mpi" or BACKEND ==
  "gloo":`` builds the CPU model of the no_sync tests): the global is :class:`GlooLike`, the
  string "commlib" that also compares equal to "gloo", so those bodies take gloo's branch, as
  the decorators did.

Importing this module imports :mod:`autograd_bridge` (which registers the backend name) in
every rank's process too: the ranks import this module to find the test class.

Environment, as torch's runner reads it: ``BACKEND`` (gloo or commlib), ``WORLD_SIZE``,
``TEMP_DIR`` (set per test by the harness itself). ``TORCHSUITE_START``: how rank processes
start: ``fork`` (the default: forked from the test's parent, which imported torch and this
module once and never touches a process group itself, so each rank starts in a fraction of a
second instead of importing torch again: ~20 s a test on a loaded machine), ``forkserver``
(forked from a server that imported them once; the per-test environment the harness sets is
handed to each rank) or ``spawn`` (torch's way: a fresh interpreter per rank and test).
"""

from __future__ import annotations

import os

BACKEND = os.environ.get("BACKEND", "")
BACKENDS = ("gloo", "commlib")
START_METHODS = ("fork", "forkserver", "spawn")
GLOO = "gloo"

if BACKEND not in BACKENDS:
    raise RuntimeError(f"tests.torchsuite.harness: BACKEND={BACKEND!r}; expected one of {BACKENDS}")

if BACKEND == "commlib":
    import autograd_bridge  # noqa: F401 - registers the "commlib" backend name

os.environ["BACKEND"] = GLOO
try:
    import torch
    from torch.testing._internal import common_distributed
    from torch.testing._internal.common_distributed import TEST_SKIPS, DistTestCases
    from torch.testing._internal.distributed import distributed_test
finally:
    os.environ["BACKEND"] = BACKEND


class GlooLike(str):
    """A backend name that also equals "gloo": what the suite's bodies compare ``BACKEND`` with."""

    def __eq__(self, other):
        return str.__eq__(self, other) or other == GLOO

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _give_commlib_gloo_s_place() -> None:
    distributed_test.BACKEND = GlooLike(BACKEND)
    for backends in DistTestCases.backend_feature.values():
        if GLOO in backends:
            backends.add(BACKEND)
    for backends in DistTestCases.skip_collective.values():
        if GLOO in backends:
            backends.add(BACKEND)
    for allow_list in (distributed_test.PROFILING_SUPPORTED_BACKENDS,
                       distributed_test.CUDA_PROFILING_SUPPORTED_BACKENDS,
                       distributed_test.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        if GLOO in allow_list and BACKEND not in allow_list:
            allow_list.append(BACKEND)


if BACKEND != GLOO:
    _give_commlib_gloo_s_place()

# The variables the harness sets per test (in the test's parent) that its ranks read.
_PER_TEST_VARIABLES = ("TEMP_DIR", "INIT_METHOD", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "BACKEND")


def start_method() -> str:
    method = os.environ.get("TORCHSUITE_START", "fork")
    if method not in START_METHODS:
        raise RuntimeError(f"TORCHSUITE_START={method!r}; expected one of {START_METHODS}")
    return method


class TestDistBackendWithSpawn(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    """torch's test class, as test_distributed_spawn.py makes it."""

    def setUp(self):
        super().setUp()
        method = start_method()
        if method == "spawn":
            self._spawn_processes()
        else:
            context = torch.multiprocessing.get_context(method)
            if method == "forkserver":
                context.set_forkserver_preload([__name__])
            self._start_processes(context.Process)

    def _start_processes(self, proc) -> None:
        # As torch's, with the per-test variables handed over: a forkserver's children inherit
        # the server's environment, not this process's.
        self.processes = []
        environ = {name: os.environ[name] for name in _PER_TEST_VARIABLES if name in os.environ}
        for rank in range(int(self.world_size)):
            parent_conn, child_conn = torch.multiprocessing.Pipe()
            process = proc(target=self.__class__._run, name=f"process {rank}",
                           args=(rank, self._current_test_name(), self.file_name, child_conn),
                           kwargs={"environ": environ})
            process.start()
            self.pid_to_pipe[process.pid] = parent_conn
            self.processes.append(process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, environ=None, **kwargs):
        os.environ.update(environ or {})
        super()._run(rank, test_name, file_name, pipe, **kwargs)

__all__ = ["TestDistBackendWithSpawn", "BACKEND", "BACKENDS", "START_METHODS", "TEST_SKIPS", "common_distributed"]
