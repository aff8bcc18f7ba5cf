"""Single-process unit tests of the pieces that need no peer: config, validation, work, registry."""

import dataclasses
import sys
import threading

import numpy as np
import pytest

import commlib
from commlib import CommTimeoutError, InvalidUsageError, ReduceOp
from commlib.algorithms.registry import get_algorithm, register_algorithm
from commlib.config import Config
from commlib.execution.fingerprint import describe_mismatch
from commlib.group.validation import check_buffer, check_no_overlap, check_root, check_timeout


def test_config_reads_every_variable():
    config = Config.from_env({"COMMLIB_ALGO": "ring", "COMMLIB_DEBUG": "yes", "COMMLIB_TIMEOUT": "7.5",
                              "COMMLIB_SEGMENT_BYTES": "4096", "COMMLIB_GPU_TRANSPORT": "host_staged",
                              "COMMLIB_CRASH_WITNESS": "0", "COMMLIB_COST_MODEL": " model.json "})
    assert config == Config(algorithm_override="ring", debug=True, timeout=7.5, segment_bytes=4096,
                            gpu_transport="host_staged", crash_witness=False, cost_model="model.json")
    assert Config.from_env({}) == Config()
    assert Config.from_env({"COMMLIB_SHM": "0", "COMMLIB_SHM_HEAP_BYTES": "4096", "COMMLIB_SHM_SLOT_BYTES": "64",
                            "COMMLIB_SHM_STAGING_BYTES": "128"}) == Config(shm=False, shm_heap_bytes=4096,
                                                                           shm_slot_bytes=64, shm_staging_bytes=128)
    assert Config.from_env({"COMMLIB_SHM_CMA": "0"}) == Config(shm_cross_memory=False)
    with pytest.raises(ValueError, match="COMMLIB_SHM_CMA"):
        Config.from_env({"COMMLIB_SHM_CMA": "sometimes"})
    with pytest.raises(ValueError, match="COMMLIB_SHM_SLOT_BYTES"):
        Config.from_env({"COMMLIB_SHM_SLOT_BYTES": "4"})
    with pytest.raises(ValueError, match="COMMLIB_TIMEOUT"):
        Config.from_env({"COMMLIB_TIMEOUT": "-1"})
    with pytest.raises(ValueError, match="COMMLIB_DEBUG"):
        Config.from_env({"COMMLIB_DEBUG": "maybe"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().debug = True


def test_config_reads_an_algorithm_override_per_collective():
    config = Config.from_env({"COMMLIB_ALGO": "ring", "COMMLIB_ALGO_ALLGATHER": " bruck ",
                              "COMMLIB_ALGO_BARRIER": "native", "COMMLIB_ALGO_REDUCE": ""})
    assert config.algorithm_override_for("allreduce") == "ring"
    assert config.algorithm_override_for("allgather") == "bruck"
    assert config.algorithm_override_for("barrier") == "native"
    assert config.algorithm_override_for("reduce") is None  # empty means unset
    assert config.algorithm_override_for("broadcast") is None
    assert Config.from_env({}).collective_algorithms == ()


def test_auto_tables_cover_every_collective_and_name_registered_algorithms():
    from commlib.algorithms.registry import COLLECTIVES, algorithm_names
    from commlib.selection.auto import _TABLES, choose

    assert set(_TABLES) == set(COLLECTIVES)
    for collective, table in _TABLES.items():
        for world_class, rows in table.items():
            assert rows[-1][0] == float("inf"), (collective, world_class)  # every size is covered
            for _, name in rows:
                assert name in algorithm_names(collective), (collective, world_class, name)
    for collective in COLLECTIVES:
        for size in (1, 2, 3, 4, 8):
            for nbytes in (0, 8, 1 << 20, 1 << 30):
                assert choose(collective, nbytes, size, algorithm_names(collective)) in algorithm_names(collective)
    assert choose("alltoallv", 8, 4, algorithm_names("alltoallv")) == choose("alltoallv", 1 << 30, 4,
                                                                          algorithm_names("alltoallv"))


def test_auto_picks_shm_direct_where_it_was_measured_faster_by_size_probe_and_buffer_kind():
    from commlib.selection.auto import choose_shared_memory_mover

    assert choose_shared_memory_mover("broadcast", 1 << 20, 4) == "shm_direct"
    assert choose_shared_memory_mover("broadcast", 64 << 20, 8) == "shm_direct"
    assert choose_shared_memory_mover("broadcast", 512 << 10, 4) is None  # the MPI table
    for size in (1, 2, 3, 5):
        assert choose_shared_memory_mover("broadcast", 16 << 20, size) is None
    # Two ranks: only where they can copy from each other's memory (the broadcast's split copy).
    assert choose_shared_memory_mover("broadcast", 1 << 20, 2, cross_memory=True) == "shm_direct"
    assert choose_shared_memory_mover("broadcast", (1 << 20) - 1, 2, cross_memory=True) is None
    assert choose_shared_memory_mover("broadcast", 64 << 20, 2) is None
    assert choose_shared_memory_mover("broadcast", 64 << 20, 4, cross_memory=True) == "shm_direct"
    assert choose_shared_memory_mover("gather", 1 << 20, 2, cross_memory=True) == "shm_direct"
    assert choose_shared_memory_mover("scatter", 2 << 20, 2, cross_memory=True) is None
    assert choose_shared_memory_mover("scatter", 4 << 20, 2, cross_memory=True) == "shm_direct"
    assert choose_shared_memory_mover("allgather", 64 << 20, 2, cross_memory=True) is None
    assert choose_shared_memory_mover("allgather", 4 << 20, 8) == "shm_direct"
    assert choose_shared_memory_mover("allgather", 512 << 10, 4) is None
    assert choose_shared_memory_mover("allgather", 16 << 20, 4) is None  # above 4 MiB: the MPI table
    assert choose_shared_memory_mover("gather", 256 << 10, 4) == "shm_direct"
    assert choose_shared_memory_mover("gather", (256 << 10) - 1, 8) is None
    assert choose_shared_memory_mover("scatter", 1 << 20, 8) == "shm_direct"
    assert choose_shared_memory_mover("scatter", (1 << 20) - 1, 4) is None
    for collective in ("alltoall", "reduce"):
        assert choose_shared_memory_mover(collective, 16 << 20, 4) is None
    for collective in ("gather", "scatter", "alltoall", "reduce"):
        assert choose_shared_memory_mover(collective, 16 << 20, 2) is None  # no cross-memory copies
        assert choose_shared_memory_mover(collective, 16 << 20, 3) is None
    # Every buffer symmetric: allgather and alltoall take shm_direct above 512 KiB at 2, 4 and 8
    # ranks, whatever the cross-memory probe; the other movers and world sizes choose as before.
    for collective in ("allgather", "alltoall"):
        for size in (2, 4, 8):
            for cross_memory in (False, True):
                chosen = [choose_shared_memory_mover(collective, nbytes, size, cross_memory, symmetric=True)
                          for nbytes in (512 << 10, (512 << 10) + 1, 64 << 20)]
                assert chosen == [choose_shared_memory_mover(collective, 512 << 10, size, cross_memory),
                                  "shm_direct", "shm_direct"], (collective, size, cross_memory, chosen)
        assert choose_shared_memory_mover(collective, 64 << 20, 3, symmetric=True) is None
        assert choose_shared_memory_mover(collective, 64 << 20, 1, symmetric=True) is None
    for collective in ("broadcast", "gather", "scatter"):
        for size in (2, 3, 4):
            for nbytes in (1 << 20, 16 << 20):
                assert (choose_shared_memory_mover(collective, nbytes, size, True, symmetric=True)
                        == choose_shared_memory_mover(collective, nbytes, size, True))


def test_auto_allreduce_on_one_host_over_sockets_takes_shm_twoshot_where_mpi_would_take_ring():
    from commlib.selection.selector import AlgorithmSelector
    from commlib.topology import Topology
    from commlib.transports.mpi.transport import MPITransport
    from commlib.transports.socket.transport import SocketTransport

    assert MPITransport.local_messages_in_shared_memory and not SocketTransport.local_messages_in_shared_memory
    one_host = Topology.single_host(0, 2)

    def chosen(nbytes, messages_in_shared_memory, shared_memory=True):
        return AlgorithmSelector(2, one_host, Config(), shared_memory=shared_memory, cross_memory=False,
                                 messages_in_shared_memory=messages_in_shared_memory).resolve("auto", nbytes)

    # Plain 64 MiB buffers at two ranks: the one-host table leaves them to the MPI table.
    assert chosen(64 << 20, True) not in ("shm_twoshot", "shm_oneshot")
    assert chosen(64 << 20, False) == "shm_twoshot"
    # Where the shared-memory table chooses, both transports take its choice.
    assert chosen(1 << 10, True) == chosen(1 << 10, False) == "shm_oneshot"
    # Without shared memory there is nothing to take instead.
    assert chosen(64 << 20, False, shared_memory=False) == chosen(64 << 20, True, shared_memory=False)


def test_the_fast_paths_limits_follow_the_auto_tables_first_rows():
    """``leading_bound``: up to where "auto" means the algorithm from the smallest size on, so
    the fast path of "auto" runs what the general path would pick (and a rank on either matches)."""
    from commlib.selection.auto import choose, leading_bound

    inf = float("inf")
    assert leading_bound(2, None, "scatter", "binomial") == 64 << 10
    assert choose("scatter", 64 << 10, 2, ["native", "binomial"]) == "binomial"
    assert choose("scatter", (64 << 10) + 1, 2, ["native", "binomial"]) == "native"
    assert leading_bound(2, None, "scatter", "native") == -1  # the first row is binomial
    assert leading_bound(4, None, "scatter", "native") == inf
    assert leading_bound(4, None, "scatter", "binomial") == -1
    assert leading_bound(2, "native", "scatter", "native") == inf  # an override wins at every size
    assert leading_bound(2, "native", "scatter", "binomial") == -1
    assert leading_bound(1, None, "broadcast", "native") == inf
    assert leading_bound(1, None, "broadcast", "binomial") == -1


def test_validation_messages_say_what_was_expected():
    with pytest.raises(InvalidUsageError, match="C-contiguous"):
        check_buffer(np.zeros((4, 4))[:, 1], "allreduce")
    flat = check_buffer(np.zeros((2, 3), np.float32), "allreduce")
    assert flat.shape == (6,) and flat.base is not None
    with pytest.raises(InvalidUsageError, match="root 5 out of range"):
        check_root(5, 4, "broadcast")
    with pytest.raises(InvalidUsageError, match="root must be an int"):
        check_root(True, 4, "broadcast")
    for bad in (0, -1, float("nan"), float("inf"), "3"):
        with pytest.raises(InvalidUsageError, match="timeout"):
            check_timeout(bad, "init")
    a = np.zeros(8)
    with pytest.raises(InvalidUsageError, match="overlap"):
        check_no_overlap("allgather", a, a[2:4])
    check_no_overlap("allgather", np.zeros(4), np.zeros(2))


def test_reduce_op_coercion():
    assert ReduceOp.coerce("max") is ReduceOp.MAX
    with pytest.raises(InvalidUsageError, match="expected one of SUM"):
        ReduceOp.coerce(3)


def test_work_completes_once_and_reraises_on_every_wait():
    work = commlib.Work("allreduce", 3, 16)
    seen = []
    work.add_done_callback(lambda w: seen.append(w.is_success()))
    with pytest.raises(CommTimeoutError, match="allreduce #3"):
        work.wait(timeout=0.01)
    error = CommTimeoutError("boom")
    threading.Thread(target=work.complete, args=(error,)).start()
    for _ in range(2):
        with pytest.raises(CommTimeoutError, match="boom"):
            work.wait(timeout=5)
    work.complete(None)  # a second completion is ignored
    assert seen == [False] and work.exception() is error
    late = []
    work.add_done_callback(lambda w: late.append(True))
    assert late == [True]


def test_registry_rejects_bad_names_and_clashes():
    with pytest.raises(InvalidUsageError, match="identifier"):
        register_algorithm("not a name", lambda *a, **k: None)
    with pytest.raises(InvalidUsageError, match="reserved"):
        register_algorithm("auto", lambda *a, **k: None)
    with pytest.raises(InvalidUsageError, match="already registered"):
        register_algorithm("native", lambda *a, **k: None)
    with pytest.raises(InvalidUsageError, match="unknown allreduce algorithm 'nope'"):
        get_algorithm("nope")
    with pytest.raises(InvalidUsageError,
                       match="unknown gather algorithm 'ring': expected one of auto, binomial, native"):
        get_algorithm("ring", "gather")
    with pytest.raises(InvalidUsageError, match="already registered"):
        register_algorithm("binomial", lambda *a, **k: None, collective="broadcast")
    assert "native" in commlib.algorithms()


def test_mismatch_description_names_fields_and_ranks():
    text = describe_mismatch([["4", "allreduce", "float32", "(1000,)", "SUM", "-1", "ring"],
                              ["4", "allreduce", "float32", "(10, 100)", "SUM", "-1", "ring"],
                              ["4", "broadcast", "float32", "(1000,)", "-", "0", ""]], "allreduce", 4)
    assert "shape differs (ranks 0,2: (1000,) vs rank 1: (10, 100))" in text
    assert "collective differs" in text and "rank 2 broadcast" in text


def test_import_needs_neither_torch_nor_cupy():
    import subprocess
    import sys

    code = ("import sys, commlib; bad = [m for m in ('torch', 'cupy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_commlib_handle_is_a_work_handle():
    from commlib import WorkHandle
    from commlib.gpu.work import GpuWork
    from commlib.group.p2p import P2PWork
    from commlib.execution.work import Work

    for handle_class in (Work, P2PWork, GpuWork):
        missing = [name for name in ("wait", "is_completed", "result", "add_done_callback")
                   if not callable(getattr(handle_class, name, None))]
        assert not missing, f"{handle_class.__name__} lacks {missing} of commlib.WorkHandle"
    assert isinstance(Work("allreduce"), WorkHandle)
    assert not isinstance(object(), WorkHandle)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is Linux's")
def test_a_sleeping_wait_lowers_its_threads_timer_slack_and_puts_it_back():
    """FineSleeper: the slack is 1 us from the first sleep on, and what the thread had after restore()."""
    import ctypes
    import ctypes.util

    from commlib.platform.timer_slack import FINE_SLACK_NS, FineSleeper

    prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    set_slack, get_slack = 29, 30  # PR_SET_TIMERSLACK, PR_GET_TIMERSLACK
    before = 50_000  # Linux's default, set here so the test does not depend on what the thread had
    original = prctl(get_slack, 0, 0, 0, 0)
    assert prctl(set_slack, before, 0, 0, 0) == 0
    sleeper = FineSleeper()
    sleeper.restore()  # never slept: nothing to put back
    assert prctl(get_slack, 0, 0, 0, 0) == before
    sleeper.sleep(1e-5)
    assert prctl(get_slack, 0, 0, 0, 0) == FINE_SLACK_NS
    sleeper.sleep(1e-5)
    sleeper.restore()
    assert prctl(get_slack, 0, 0, 0, 0) == before
    prctl(set_slack, original, 0, 0, 0)


def test_a_long_wait_sleeps_longer_and_a_short_one_keeps_its_cap():
    from commlib.platform.backoff import LONG_WAIT_MAX_SLEEP_SECONDS, next_sleep

    cap = 5e-4
    sleep, waited = 1e-5, 0.0
    for _ in range(10):  # a short wait: doubling up to the waiter's own cap, never past it
        sleep = next_sleep(sleep, waited, cap)
        waited += sleep
    assert sleep == cap and waited < 0.01
    # 0.2 s in: past the cap, doubling up to 1% of the time waited, and held there
    assert next_sleep(cap, 0.2, cap) == pytest.approx(1e-3)
    assert next_sleep(1e-3, 0.2, cap) == pytest.approx(2e-3)
    assert next_sleep(2e-3, 0.2, cap) == pytest.approx(2e-3)
    assert next_sleep(4e-3, 60.0, cap) == LONG_WAIT_MAX_SLEEP_SECONDS  # a wait for a timeout: 5 ms at most
