"""Many hosts on one machine: network namespaces with their own host names, joined by a switch.

Multi-host behaviour (ranks on different hosts talking TCP, host names that do not resolve,
a rate-limited network) is tested on "hosts" made here, on this machine, as root::

    python -m commlib.cluster up 2 --rate 1gbit            # prints the cluster's name
    python -m commlib.cluster run -n 4 -ppn 2 -- .venv/bin/python mpi_examples/train_digits.py
    python -m commlib.cluster limit h1 10mbit                # h1 turns slow (none: back)
    python -m commlib.cluster down

From Python (the tests)::

    with Cluster(hosts=2, rate="1gbit") as cluster:
        result = cluster.run(nprocs=4, ppn=2, argv=[sys.executable, "x.py"], timeout=60)

``run`` starts the venv's ``mpiexec`` (MPICH's hydra) inside the first host, with ssh replaced
by a launcher script that starts hydra's proxies inside the other hosts, and by default forces
MPICH onto the network: its OFI netmod over libfabric's TCP provider on the hosts' ``eth0``
(otherwise MPICH's UCX path finds the other "hosts" are the same machine and uses shared
memory). Ranks of one host still share memory, as on a real cluster.

A cluster made from Python belongs to its process: removed on ``down()``, at the end of the
``with`` block, at exit, on SIGTERM/SIGHUP; one whose owner was killed outright is removed by
the next ``up``. One made by the CLI's ``up`` is kept until ``down`` (or, with ``--owner PID``,
until a later ``up`` finds PID gone). See :mod:`commlib.cluster.netns` (the plumbing) and
:mod:`commlib.cluster.state` (names, subnets, state files).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from commlib.cluster import netns
from commlib.cluster.state import (HOST_INTERFACE, STATE_DIR, ClusterError, check_request, describe, list_states,
                                   new_state, owner_alive, parse_rate, state_lock)

__all__ = ["Cluster", "ClusterError", "ClusterTimeout", "unavailable_reason", "reap_stale",
           "network_env"]

unavailable_reason = netns.unavailable_reason


class ClusterTimeout(ClusterError):
    """A command in the cluster outlived its timeout; it was killed. ``output`` has what it printed."""

    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output


def network_env(tcp: bool = True) -> Dict[str, str]:
    """The settings that make MPI (and gloo) use the hosts' network interface.

    ``tcp``: MPICH's OFI netmod with libfabric's TCP provider (between hosts; shared memory
    inside one). Without it MPICH keeps its default (UCX), which uses shared memory between our
    namespaces, since they share one kernel.
    """
    env = {"FI_TCP_IFACE": HOST_INTERFACE, "GLOO_SOCKET_IFNAME": HOST_INTERFACE}
    if tcp:
        env.update({"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"})
    return env


def reap_stale() -> List[str]:
    """Remove every cluster whose owner process is gone; their names."""
    reaped = []
    with state_lock():
        for state in list_states():
            if owner_alive(state):
                continue
            try:
                netns.tear_down(state)
                reaped.append(state.name)
            except ClusterError as error:  # someone else's leftovers must not stop this up
                sys.stderr.write(f"commlib.cluster: reaping a stale cluster: {error}\n")
    return reaped


_owned: List["Cluster"] = []
_owned_lock = threading.Lock()
_cleanup_installed = False


class Cluster:
    """``hosts`` hosts on this machine, each a network namespace with its own host name.

    Created at once (after removing clusters of dead owners). ``rate`` (tc units: ``"1gbit"``,
    ``"100mbit"``) limits every host's link in both directions. ``name`` (``cl`` + letters or
    digits; default random) names the namespaces ``NAME-h0``, ``NAME-h1``..., ``NAME-sw``.
    ``persist``: no owner, kept until :meth:`down` (as the CLI's ``up`` does); ``owner_pid``: the
    process whose end makes it stale (default this one).
    """

    def __init__(self, hosts: int = 2, *, rate: Optional[str] = None, name: Optional[str] = None,
                 persist: bool = False, owner_pid: Optional[int] = None, origin: str = "api"):
        check_request(hosts, rate=rate, name=name)
        reason = netns.unavailable_reason()
        if reason is not None:
            raise ClusterError(f"cannot make a cluster here: {reason}")
        reap_stale()
        owner = None if persist else (owner_pid or os.getpid())
        with state_lock():
            self.state = new_state(hosts, rate=rate, name=name, owner_pid=owner, origin=origin)
        if owner == os.getpid():
            _own(self)
        try:
            netns.build(self.state)
        except BaseException:
            self.down()
            raise

    @classmethod
    def attach(cls, name: Optional[str] = None) -> "Cluster":
        """An existing cluster by ``name``; without one, the only cluster made by the CLI's
        ``up`` (never one a program made for itself)."""
        states = list_states()
        if name is not None:
            chosen = [state for state in states if state.name == name]
        else:
            chosen = [state for state in states if state.origin == "cli"]
        if len(chosen) != 1:
            found = ", ".join(f"{state.name} ({state.origin})" for state in states) or "none"
            raise ClusterError(f"no cluster named {name!r} (clusters: {found})" if name else
                               f"which cluster? give --name (clusters on this machine: {found})")
        cluster = cls.__new__(cls)
        cluster.state = chosen[0]
        return cluster

    @property
    def name(self) -> str:
        return self.state.name

    @property
    def hostnames(self) -> List[str]:
        return [host.hostname for host in self.state.hosts]

    @property
    def addresses(self) -> List[str]:
        return [host.address for host in self.state.hosts]

    def __repr__(self) -> str:
        return f"<commlib.cluster.Cluster {self.name}: {len(self.hostnames)} hosts, rate {self.state.rate}>"

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc_info) -> None:
        self.down()

    # -- running things ------------------------------------------------------------------------
    def mpiexec_argv(self, nprocs: int, ppn: int, argv: Sequence[str], *,
                     hosts: Optional[Sequence[str]] = None, tcp: bool = True,
                     mpiexec: Optional[str] = None) -> List[str]:
        """The full command line :meth:`run` starts (mpiexec inside the first of ``hosts``)."""
        chosen = [self.state.host(h).hostname for h in (hosts or self.hostnames)]
        settings = [part for key, value in network_env(tcp).items() for part in ("-genv", key, value)]
        launch = [mpiexec or _mpiexec(), "-iface", HOST_INTERFACE, "-launcher", "ssh",
                  "-launcher-exec", self.state.launcher, "-hosts", ",".join(chosen),
                  "-n", str(nprocs), "-ppn", str(ppn), *settings, *argv]
        return netns.host_argv(self.state, chosen[0], launch)

    def run(self, nprocs: int, ppn: int, argv: Sequence[str], *, hosts: Optional[Sequence[str]] = None,
            tcp: bool = True, env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
            capture: bool = True, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``nprocs`` ranks, ``ppn`` per host, under mpiexec across the hosts.

        Returns mpiexec's exit status and (with ``capture``) its output, stderr merged into
        stdout. Past ``timeout`` seconds everything it started is killed and ClusterTimeout raised.
        """
        full = self.mpiexec_argv(nprocs, ppn, argv, hosts=hosts, tcp=tcp)
        return self._run(full, env=env, timeout=timeout, capture=capture, cwd=cwd,
                         what=f"mpiexec -n {nprocs} -ppn {ppn} {shlex.join(argv)}")

    def exec(self, host: str, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
             timeout: Optional[float] = None, capture: bool = True) -> subprocess.CompletedProcess:
        """Run ``argv`` on one host (by hostname or ``h0``, ``h1``...), as :meth:`run` does."""
        return self._run(netns.host_argv(self.state, host, argv), env=env, timeout=timeout,
                         capture=capture, what=f"{shlex.join(argv)} on {self.state.host(host).hostname}")

    def popen(self, host: str, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` on one host and return at once (the caller waits for it)."""
        return subprocess.Popen(netns.host_argv(self.state, host, argv), **popen_kwargs)

    def _run(self, full: List[str], *, env, timeout, capture, cwd=None, what: str):
        environment = dict(os.environ)
        environment.update(env or {})
        output = subprocess.PIPE if capture else None
        process = subprocess.Popen(full, stdout=output, stderr=subprocess.STDOUT if capture else None,
                                   text=True, env=environment, cwd=cwd, start_new_session=True)
        try:
            out, _ = process.communicate(timeout=timeout)
        except BaseException as interruption:  # a timeout, or Ctrl-C: leave nothing running
            _kill_group(process.pid)
            netns.kill_namespace_processes([host.hostname for host in self.state.hosts])
            out, _ = process.communicate()
            if isinstance(interruption, subprocess.TimeoutExpired):
                raise ClusterTimeout(f"cluster {self.name}: {what} did not finish within {timeout:g} s; "
                                     f"killed", out or "") from None
            raise
        return subprocess.CompletedProcess(full, process.returncode, out or "", "")

    def limit(self, host: str, rate: Optional[str]) -> None:
        """Limit one host's link to ``rate`` (tc units) both ways, now, while jobs run on it (a
        host that turns slow); ``None``: back to the cluster's rate (none if it has none)."""
        if rate is not None:
            parse_rate(rate)  # a clear error before anything is changed
        netns.limit_host(self.state, host, rate)

    # -- removing it ---------------------------------------------------------------------------
    def down(self) -> None:
        """Kill what runs on the hosts and remove everything the cluster made. Idempotent."""
        with state_lock():
            netns.tear_down(self.state)
        with _owned_lock:
            if self in _owned:
                _owned.remove(self)


def _mpiexec() -> str:
    candidate = Path(sys.executable).parent / "mpiexec"
    found = str(candidate) if candidate.exists() else shutil.which("mpiexec")
    if found is None:
        raise ClusterError("no mpiexec next to this Python nor on PATH (pip install mpich)")
    return found


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _own(cluster: Cluster) -> None:
    """Remove ``cluster`` at exit and on SIGTERM/SIGHUP too (a SIGKILL is left to the next ``up``)."""
    global _cleanup_installed
    with _owned_lock:
        _owned.append(cluster)
        if _cleanup_installed:
            return
        _cleanup_installed = True
    atexit.register(_down_owned)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) == signal.SIG_DFL:
                signal.signal(signum, _down_owned_and_die)


def _down_owned() -> None:
    with _owned_lock:
        clusters = list(_owned)
    for cluster in clusters:
        try:
            cluster.down()
        except ClusterError as error:
            sys.stderr.write(f"commlib.cluster: {error}\n")


def _down_owned_and_die(signum, _frame) -> None:
    _down_owned()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


# -- the command line ----------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.cluster", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="make N hosts")
    up.add_argument("hosts", type=int)
    up.add_argument("--rate", help="limit every host's link, both directions (tc units: 1gbit, 100mbit)")
    up.add_argument("--name", help="the cluster's name: 'cl' + letters/digits (default random)")
    up.add_argument("--owner", type=int, metavar="PID",
                    help="remove it (at a later up) once process PID has exited, e.g. --owner $$ "
                         "in a script; default: kept until down")
    run = commands.add_parser("run", help="mpiexec across the hosts: run [options] -- CMD...")
    run.add_argument("--name")
    run.add_argument("-n", type=int, required=True, dest="nprocs")
    run.add_argument("-ppn", "--ppn", type=int, required=True)
    run.add_argument("--hosts", help="comma-separated (h0,h1 or full host names); default all")
    run.add_argument("--tcp", action=argparse.BooleanOptionalAction, default=True,
                     help="force MPICH onto TCP between hosts (default; --no-tcp: MPICH's default)")
    run.add_argument("--timeout", type=float, help="kill everything after this many seconds")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    on = commands.add_parser("exec", help="run a command on one host: exec [--name N] HOST -- CMD...")
    on.add_argument("--name")
    on.add_argument("host")
    on.add_argument("cmd", nargs=argparse.REMAINDER)
    limit = commands.add_parser("limit", help="limit one host's link now: limit [--name N] HOST RATE|none")
    limit.add_argument("--name")
    limit.add_argument("host")
    limit.add_argument("rate", help="tc units (10mbit, 1gbit), or none: back to the cluster's rate")
    down = commands.add_parser("down", help="remove a cluster (idempotent with --name)")
    down.add_argument("--name")
    commands.add_parser("list", help="the clusters on this machine")
    args = parser.parse_args(argv)
    try:
        return _command(args, parser)
    except ClusterTimeout as error:
        sys.stderr.write(f"commlib.cluster: {error}\n")
        return 124
    except ClusterError as error:
        sys.stderr.write(f"commlib.cluster: {error}\n")
        return 1


def _command(args, parser) -> int:
    if args.command == "up":
        cluster = Cluster(args.hosts, rate=args.rate, name=args.name, persist=args.owner is None,
                          owner_pid=args.owner, origin="cli")
        print(cluster.name)
        for host in cluster.state.hosts:
            print(f"  {host.hostname}  {host.address}", file=sys.stderr)
        return 0
    if args.command == "list":
        for state in list_states():
            print(describe(state))
        return 0
    if args.command == "down":
        if args.name is not None and not (STATE_DIR / f"{args.name}.json").exists():
            return 0  # idempotent: already gone
        Cluster.attach(args.name).down()
        return 0
    if args.command == "limit":
        rate = None if args.rate == "none" else args.rate
        if rate is not None:
            parse_rate(rate)  # a clear error before the cluster is looked up
        Cluster.attach(args.name).limit(args.host, rate)
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error(f"{args.command}: give the command after --")
    cluster = Cluster.attach(args.name)
    if args.command == "exec":
        return cluster.exec(args.host, cmd, capture=False).returncode
    hosts = args.hosts.split(",") if args.hosts else None
    return cluster.run(args.nprocs, args.ppn, cmd, hosts=hosts, tcp=args.tcp, timeout=args.timeout,
                       capture=False).returncode
