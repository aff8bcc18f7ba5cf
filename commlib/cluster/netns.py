"""The plumbing of :mod:`commlib.cluster`: namespaces, links, rate limits, hydra's launcher.

One cluster is a *switch* namespace holding a bridge, and one namespace per host, each with
loopback and one interface ``eth0`` (a veth pair whose other end is a port of the bridge). Both
ends are created directly inside their namespaces: nothing is ever added to the machine's own
namespace, so no address of ours is visible there and no traffic can leave the machine. Deleting
the namespaces deletes everything else (veths, bridge, qdiscs) with them.

A rate limit is a ``tc tbf`` on both ends of each host's veth: ``eth0``'s egress limits what the
host sends, the bridge port's egress what it receives.

A host's own host name comes from a UTS namespace made when a command starts there
(``unshare --uts``), so each rank sees its host's name in ``gethostname()`` and MPI's processor
name, and hydra places ranks by it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path
from typing import List, Optional, Sequence

from commlib.cluster.state import HOST_INTERFACE, ClusterError, ClusterState, parse_rate

__all__ = ["unavailable_reason", "build", "tear_down", "host_argv", "namespace_exists", "limit_host",
           "kill_namespace_processes", "write_launcher", "command"]

_BRIDGE = "br0"
_COMMAND_TIMEOUT = 30.0
_TOOLS = ("ip", "tc", "unshare", "hostname", "sh")
NETNS_ETC = Path("/etc/netns")  # per-namespace files `ip netns exec` mounts over /etc


def command(argv: Sequence[str], what: str, *, timeout: float = _COMMAND_TIMEOUT,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv``; a non-zero exit (with ``check``) or a timeout raises a ClusterError naming it."""
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what}: `{shlex.join(argv)}` did not finish within {timeout:g} s") from None
    except OSError as error:
        raise ClusterError(f"{what}: `{shlex.join(argv)}` could not start: {error}") from None
    if check and result.returncode != 0:
        raise ClusterError(f"{what}: `{shlex.join(argv)}` exited with {result.returncode}: "
                           f"{(result.stderr or result.stdout).strip()[-2000:]}")
    return result


def unavailable_reason() -> Optional[str]:
    """Why clusters cannot be made here (not root, a tool missing), or None when they can."""
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing command(s) {', '.join(missing)} (iproute2, util-linux)"
    probe = f"clprobe{os.getpid()}"
    made = command(["ip", "netns", "add", probe], "probe", check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()[-500:]}"
    command(["ip", "netns", "del", probe], "probe", check=False)
    return None


def namespace_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def build(state: ClusterState) -> None:
    """Create the switch, the hosts, their links and rate limits described by ``state``."""
    sw = state.switch
    ip_in = lambda namespace, *args: command(["ip", "-n", namespace, *args], f"cluster {state.name}: {namespace}")  # noqa: E731
    command(["ip", "netns", "add", sw], f"cluster {state.name}: switch namespace")
    ip_in(sw, "link", "set", "lo", "up")
    ip_in(sw, "link", "add", _BRIDGE, "type", "bridge")
    ip_in(sw, "link", "set", _BRIDGE, "up")
    prefix = state.subnet.split("/")[1]
    for host in state.hosts:
        ns = host.hostname
        command(["ip", "netns", "add", ns], f"cluster {state.name}: host namespace")
        ip_in(ns, "link", "set", "lo", "up")
        command(["ip", "link", "add", "name", HOST_INTERFACE, "netns", ns, "type", "veth",
                 "peer", "name", host.switch_port, "netns", sw], f"cluster {state.name}: link of {ns}")
        ip_in(sw, "link", "set", host.switch_port, "master", _BRIDGE)
        ip_in(sw, "link", "set", host.switch_port, "up")
        ip_in(ns, "addr", "add", f"{host.address}/{prefix}", "dev", HOST_INTERFACE)
        ip_in(ns, "link", "set", HOST_INTERFACE, "up")
        if state.rate is not None:
            shape(state, ns, HOST_INTERFACE)        # what the host sends
            shape(state, sw, host.switch_port)     # what it receives
    write_hosts_files(state)
    write_launcher(state)


def write_hosts_files(state: ClusterState) -> None:
    """Every host's name resolves on every host: ``ip netns exec`` mounts ``/etc/netns/NS/hosts``
    over ``/etc/hosts`` (launchers such as torchrun's c10d rendezvous look their own name up)."""
    lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"{host.address} {host.hostname}" for host in state.hosts]
    for host in state.hosts:
        directory = NETNS_ETC / host.hostname
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("\n".join(lines) + "\n")


def _remove_hosts_files(state: ClusterState) -> None:
    for host in state.hosts:
        directory = NETNS_ETC / host.hostname
        try:
            (directory / "hosts").unlink()
            directory.rmdir()
        except OSError:  # absent already, or holding files of someone else's
            pass


def shape(state: ClusterState, namespace: str, device: str, rate: Optional[str] = None) -> None:
    """A ``tbf`` of ``rate`` (default: the cluster's) on ``device``'s egress in ``namespace``."""
    rate = rate or state.rate
    assert rate is not None  # only a rate-limited cluster is shaped
    bits = parse_rate(rate)
    # The bucket holds at least 64 KiB (a GSO packet) or 4 ms at the rate; the queue 50 ms.
    burst = max(64 * 1024, bits // 8 // 250)
    command(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate",
             rate, "burst", str(burst), "latency", "50ms"],
            f"cluster {state.name}: rate limit on {device} in {namespace}")


def limit_host(state: ClusterState, hostname: str, rate: Optional[str]) -> None:
    """Give one host's link ``rate`` in both directions, while things run (a host that becomes
    slow); ``None`` puts back the cluster's own rate, or no limit in a cluster without one."""
    host = state.host(hostname)
    ends = [(host.hostname, HOST_INTERFACE), (state.switch, host.switch_port)]
    for namespace, device in ends:
        if rate is not None or state.rate is not None:
            shape(state, namespace, device, rate)
        else:  # back to the veth's default queue; absent already is fine (never limited)
            subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def kill_namespace_processes(namespaces: Sequence[str]) -> List[int]:
    """SIGKILL every process inside ``namespaces`` (all started there by this tool); their pids."""
    killed = []
    for namespace in namespaces:
        if not namespace_exists(namespace):
            continue
        listed = command(["ip", "netns", "pids", namespace], f"processes in {namespace}", check=False)
        for pid in listed.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
            except (ProcessLookupError, ValueError):
                pass
    return killed


def tear_down(state: ClusterState) -> None:
    """Remove everything ``state`` describes that exists: its processes, namespaces, files. Idempotent.

    A namespace stays alive (with its links) while a process is inside it, so those are killed
    first.
    """
    kill_namespace_processes(state.namespaces)
    failures = []
    for namespace in state.namespaces:
        if namespace_exists(namespace):
            deleted = command(["ip", "netns", "del", namespace], "down", check=False)
            if deleted.returncode != 0 and namespace_exists(namespace):
                failures.append(f"{namespace}: {deleted.stderr.strip()}")
    if failures:  # the state file stays, so a later down (or up's reaping) tries again
        raise ClusterError(f"cluster {state.name}: could not delete namespace(s): {'; '.join(failures)}")
    _remove_hosts_files(state)
    for path in (Path(state.launcher), state.path):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def host_argv(state: ClusterState, hostname: str, argv: Sequence[str]) -> List[str]:
    """The command line that runs ``argv`` on host ``hostname`` of ``state``, under its host name."""
    host = state.host(hostname)
    return ["ip", "netns", "exec", host.hostname, "unshare", "--uts", "sh", "-c",
            'hostname "$1" && shift && exec "$@"', "sh", host.hostname, *argv]


def write_launcher(state: ClusterState) -> None:
    """The script hydra runs instead of ssh (``-launcher ssh -launcher-exec SCRIPT``).

    Hydra calls ``SCRIPT [-x] HOST COMMAND...`` where COMMAND is meant for a remote shell (ssh
    joins it into one string); the script runs it in the host's namespace under its host name.
    """
    hostnames = "|".join(host.hostname for host in state.hosts)
    script = f"""#!/bin/sh
# hydra's launcher for cluster {state.name} (written by python -m commlib.cluster; removed by down)
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in
  {hostnames}) ;;
  *) echo "commlib.cluster launcher: host '$host' is not in cluster {state.name} ({hostnames})" >&2; exit 255 ;;
esac
exec ip netns exec "$host" unshare --uts sh -c "hostname $host && exec $*"
"""
    path = Path(state.launcher)
    path.write_text(script)
    path.chmod(0o755)
