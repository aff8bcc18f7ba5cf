"""Jobs launched without MPI: torchrun, spawned processes, torch's variables set by hand.

The rank script is ``launch_ranks.py`` (its docstring lists the modes). Faults use our own
launcher (``tests.support.launch.run_ranks``): torchrun ends the other workers as soon as one
dies, before they could report how they noticed.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.launch import ROOT, base_env, free_port, run_ranks, run_torchrun

pytestmark = pytest.mark.launch


def _checks(output: str, size: int, modes: int = 1) -> None:
    counts = re.findall(r"rank (\d+): (\d+) checks OK", output)
    assert sorted(int(rank) for rank, _ in counts) == sorted(list(range(size)) * modes), output[-4000:]


def _commlib_files(pids) -> set:
    """The shared-memory files these processes made (their names carry the maker's pid; other
    jobs, such as tests that run at the same time, make theirs)."""
    return {path.name for pid in pids for path in Path("/dev/shm").glob(f"commlib-*-{pid}-*")}


@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun_every_collective_and_algorithm_is_exact(nproc):
    result = run_torchrun("launch_ranks.py", nproc, "collectives", timeout=240)
    _checks(result.stdout, nproc)
    pids = re.findall(r"rank \d+: pid (\d+)", result.stdout)
    assert len(pids) == nproc, result.stdout[-4000:]
    # A clean exit leaves no shared-memory file behind (ranks unlink theirs once all mapped them).
    assert _commlib_files(pids) == set()


def test_torchrun_torch_backend_collectives_mesh_and_ddp_equal_to_gloo():
    result = run_torchrun("launch_ranks.py", 2, "torch", timeout=240)
    _checks(result.stdout, 2)


@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun_point_to_point_over_sockets_through_commlib_and_torch(nproc):
    # One job: commlib's own group, shut down, then torch's default group on the backend.
    result = run_torchrun("launch_ranks.py", nproc, "p2p,p2p_torch", timeout=400)
    _checks(result.stdout, nproc, modes=2)


def test_debug_fingerprints_name_the_mismatch_on_every_rank():
    result = run_torchrun("launch_ranks.py", 2, "debug", timeout=120)
    assert len(re.findall(r"rank \d: mismatch named: .*broadcast.*allreduce", result.stdout)) == 2, result.stdout


def test_spawned_processes_meet_through_tcp_and_file_init_methods(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, sys
        import numpy as np

        def rank_main(rank, size, init_method, results):
            import commlib
            pg = commlib.init(init_method=init_method, rank=rank, world_size=size, timeout=60)
            x = np.full(16, rank + 1.0)
            pg.allreduce(x)
            results.put((rank, float(x[0]), type(pg.transport).__name__))
            commlib.shutdown()

        if __name__ == "__main__":
            size = 3
            for init_method in ("tcp://127.0.0.1:{free_port()}", "file://{tmp_path}/rendezvous"):
                context = multiprocessing.get_context("spawn")
                results = context.Queue()
                ranks = [context.Process(target=rank_main, args=(r, size, init_method, results)) for r in range(size)]
                for process in ranks:
                    process.start()
                for process in ranks:
                    process.join(120)
                got = sorted(results.get(timeout=10) for _ in range(size))
                assert got == [(r, 6.0, "SocketTransport") for r in range(size)], got
                assert all(process.exitcode == 0 for process in ranks), [p.exitcode for p in ranks]
                print("ok", init_method, flush=True)
    """))
    # MPI4PY_RC_INITIALIZE=0: spawned processes know nothing of a launcher; MPI stays out (docs/launching).
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                            env=base_env({"MPI4PY_RC_INITIALIZE": "0"}), cwd=str(ROOT))
    assert result.returncode == 0 and result.stdout.count("ok ") == 2, result.stdout + result.stderr


@pytest.mark.parametrize("elements", [4096, 16 << 20], ids=["shared-memory", "sockets"])
def test_a_killed_rank_is_named_on_every_survivor_within_a_second(tmp_path, elements):
    results = run_ranks("launch_ranks.py", 3, "kill", env={"DEATH_FILE": str(tmp_path / "death"),
                                                          "KILL_ELEMENTS": str(elements)}, timeout=120)
    assert results[1].returncode == -9, results[1]
    for survivor in (results[0], results[2]):
        found = re.search(r"PeerExitedError ([\d.]+) s after rank 1 died: .*rank 1", survivor.output)
        assert survivor.returncode == 0 and found, survivor.output[-3000:]
        # Within a second of the death, with a margin for a loaded 2-core machine.
        assert float(found.group(1)) < 3.0, survivor.output[-2000:]


def test_a_rank_that_skips_a_collective_is_named_at_the_timeout():
    results = run_ranks("launch_ranks.py", 3, "skip", env={"COMMLIB_TIMEOUT": "3"}, timeout=120)
    for survivor in (results[0], results[2]):
        assert re.search(r"CommTimeoutError after [\d.]+ s: .*rank 1", survivor.output), survivor.output[-3000:]


def test_torchrun_max_restarts_runs_the_job_again_from_a_clean_start():
    result = run_torchrun("launch_ranks.py", 2, "restart", torchrun_args=("--max-restarts", "1"), timeout=300)
    assert "rank 1: attempt 0: failing on purpose" in result.stdout, result.stdout[-4000:]
    assert len(re.findall(r"rank \d: attempt 1: sum 1 OK", result.stdout)) == 2, result.stdout[-4000:]


# -- bad launches: every rank ends within the timeout, naming the variable or the peer -----------------

def test_world_sizes_that_differ_between_ranks_are_named():
    results = run_ranks("launch_ranks.py", 2, "init", per_rank_env={1: {"WORLD_SIZE": "3"}},
                        env={"COMMLIB_TIMEOUT": "5"}, timeout=90)
    # The rank that disagrees names the variable; the one it left waiting names it.
    assert results[1].returncode != 0 and "WORLD_SIZE" in results[1].output, results[1].output[-2000:]
    assert results[0].returncode != 0 and "rank 1" in results[0].output, results[0].output[-2000:]


def test_a_rank_0_whose_world_size_differs_is_named_by_the_others():
    # Rank 0 (it serves the store) registers the world size; whatever order the ranks arrive
    # in, the one that disagrees with it names the variable, and rank 0 names who is missing.
    results = run_ranks("launch_ranks.py", 2, "init", per_rank_env={0: {"WORLD_SIZE": "3"}},
                        env={"COMMLIB_TIMEOUT": "5"}, timeout=90)
    assert results[1].returncode != 0 and "WORLD_SIZE" in results[1].output, results[1].output[-2000:]
    assert "rank 0 joined with 3" in results[1].output, results[1].output[-2000:]
    assert results[0].returncode != 0 and "did not arrive" in results[0].output, results[0].output[-2000:]


def test_a_rank_that_never_comes_is_named():
    results = run_ranks("launch_ranks.py", 3, "init", ranks=[0, 1], env={"COMMLIB_TIMEOUT": "4"}, timeout=90)
    assert results[0].returncode != 0 and "rank 2 did not arrive" in results[0].output, results[0].output[-2000:]
    # Rank 1 names rank 2 too, or, when rank 0 (the store's server) gave up first, rank 0's exit.
    assert results[1].returncode != 0 and ("rank 2 did not arrive" in results[1].output
                                           or "did the server (rank 0) exit?" in results[1].output), \
        results[1].output[-2000:]


def test_a_master_port_in_use_is_named():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        # (The squatter never answers rank 1's handshake: it gives up at the handshake timeout.)
        results = run_ranks("launch_ranks.py", 2, "init", master_port=port,
                            env={"COMMLIB_TIMEOUT": "5", "COMMLIB_HANDSHAKE_TIMEOUT": "3"}, timeout=90)
    assert results[0].returncode != 0 and str(port) in results[0].output, results[0].output[-2000:]
    assert results[1].returncode != 0, results[1].output[-2000:]


def test_an_unreachable_master_addr_is_named():
    started = time.monotonic()
    # 192.0.2.0/24 is TEST-NET-1: no host answers there.
    results = run_ranks("launch_ranks.py", 2, "init", ranks=[1],
                        env={"COMMLIB_TIMEOUT": "4", "MASTER_ADDR": "192.0.2.123"}, timeout=90)
    assert results[0].returncode != 0 and "192.0.2.123" in results[0].output, results[0].output[-2000:]
    assert time.monotonic() - started < 60
