"""Run a script across hosts made of network namespaces (:mod:`commlib.cluster`) from pytest.

Like :func:`mpirun.run_mpi`, with a hard timeout (everything the job started, on every host, is
killed: a hang is a failure), but the ranks are spread ``ppn`` per host over a cluster and talk
TCP between hosts. A test module makes one cluster for all its tests (a module-scoped fixture
around :func:`make_cluster`): making one takes a fraction of a second, but there is no reason
to pay it per test. Where clusters cannot be made (not root, no ``ip``), tests skip saying why.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import pytest

from tests.support.mpirun import MPI_SCRIPTS, ROOT, Job, Part, child_environment

from commlib.cluster.cluster import Cluster, ClusterTimeout, unavailable_reason
from commlib.cluster.netns import command, namespace_exists


def make_cluster(hosts: int = 2, rate: Optional[str] = None) -> Cluster:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no cluster of namespaces here: {reason}")
    return Cluster(hosts=hosts, rate=rate)


def run_on_cluster(cluster: Cluster, script, nprocs: int, ppn: int, *args, timeout: float = 120.0,
                   env=None, tcp: bool = True, check: bool = True):
    """Run ``python script args`` on ``nprocs`` ranks, ``ppn`` per host; fail the test on a
    timeout or (with ``check``) a non-zero exit, with the job's output. ``script`` may also be
    ``"-m module"``."""
    module = script[3:] if isinstance(script, str) and script.startswith("-m ") else None
    script = Path(script) if module is None else Path(module)
    if module is None and not script.is_absolute():
        script = MPI_SCRIPTS / script
    environment = child_environment(env)
    argv = [sys.executable, *(["-m", module] if module else [str(script)]), *map(str, args)]
    what = (f"on cluster {cluster.name} ({nprocs} ranks, {ppn} per host, {'tcp' if tcp else 'default'} "
            f"netmod): {script.name} {shlex.join(map(str, args))}")
    try:
        result = cluster.run(nprocs, ppn, argv, env=environment, timeout=timeout, tcp=tcp, cwd=str(ROOT))
    except ClusterTimeout as timed_out:
        pytest.fail(f"{what} hung: killed after {timeout:g} s\n--- output ---\n{timed_out.output[-6000:]}")
    if check and result.returncode != 0:
        pytest.fail(f"{what} exited with {result.returncode}\n--- output ---\n{result.stdout[-8000:]}")
    return result


def processes_on_hosts(cluster: Cluster):
    """``{hostname: [pids]}`` of what still runs on the cluster's hosts (after a job: nothing)."""
    found = {}
    for host in cluster.hostnames:
        if namespace_exists(host):
            pids = command(["ip", "netns", "pids", host], f"processes on {host}", check=False).stdout.split()
            if pids:
                found[host] = pids
    return found


def cluster_job(cluster: Cluster, *parts: Part, timeout: float, env=None, tcp: bool = True) -> Job:
    """A :class:`Job <tests.support.mpirun.Job>` on ``cluster``: ``check((nprocs, ppn), script, ...)``."""
    def launch(layout, argv, timeout, env):
        nprocs, ppn = layout
        return run_on_cluster(cluster, "-m tests.support.job", nprocs, ppn, *argv, timeout=timeout, env=env,
                              tcp=tcp, check=False)

    return Job(*parts, timeout=timeout, env=env, launch=launch)

