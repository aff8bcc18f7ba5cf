"""The benchmark record names the launch that made it: mpiexec, or torchrun (one host or several)."""

from __future__ import annotations

from commlib.bench.record import command_line


def test_the_command_names_mpiexec_or_torchrun_from_the_launcher_variables():
    argv = ["-b", "8", "--json", "out file.json"]
    assert command_line("commlib.bench", argv, 2, environ={}) == \
        "mpiexec -n 2 python -m commlib.bench -b 8 --json 'out file.json'"
    assert command_line("commlib.bench", argv, 2, environ={"PMI_RANK": "0", "RANK": "0", "WORLD_SIZE": "2"}) == \
        "mpiexec -n 2 python -m commlib.bench -b 8 --json 'out file.json'"  # an MPI launch wins
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert command_line("commlib.bench", argv, 2, environ=torchrun) == \
        "torchrun --nproc-per-node 2 -m commlib.bench -b 8 --json 'out file.json'"
    two_hosts = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert command_line("autograd_bridge.bench.versus_gloo", [], 4, environ=two_hosts) == \
        "torchrun --nnodes 2 --nproc-per-node 2 -m autograd_bridge.bench.versus_gloo"
    # Spawned by hand with RANK and WORLD_SIZE only: one host of all the ranks.
    assert command_line("commlib.bench", [], 3, environ={"RANK": "0", "WORLD_SIZE": "3"}) == \
        "torchrun --nproc-per-node 3 -m commlib.bench"
