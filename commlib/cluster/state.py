"""The bookkeeping of :mod:`commlib.cluster`: names, subnets, owners and state files.

Each cluster is described by one JSON file in :data:`STATE_DIR`, written *before* anything is
created (so a cluster whose owner died half-way through ``up`` is still found and removed) and
removed last by ``down``. The file records the owner process (pid and start time, so a reused
pid is not mistaken for a live owner); ``up`` first removes every cluster whose owner is gone.
Names, subnets and the state file are chosen under one lock file, so two runs starting at once
never pick the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import random
import re
import secrets
import subprocess
import threading
from pathlib import Path
from typing import Dict, Iterator, List, Optional

__all__ = ["ClusterError", "ClusterState", "HostState", "STATE_DIR", "new_state", "load_state",
           "list_states", "owner_alive", "state_lock", "parse_rate", "check_request"]

STATE_DIR = Path("/tmp/commlib-clusters")
# Our hosts' subnets come from here, one /24 per cluster, never one in use on this machine.
SUBNET_POOL = ipaddress.IPv4Network("10.233.0.0/16")
NAME_PATTERN = re.compile(r"^cl[a-z0-9]{1,20}$")  # every namespace we make starts with "cl"
HOST_INTERFACE = "eth0"  # the same name on every host: one FI_TCP_IFACE/GLOO_SOCKET_IFNAME for all
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class ClusterError(RuntimeError):
    """Making, using or removing a cluster of namespaces failed; the message says what and where."""


@dataclasses.dataclass(frozen=True)
class HostState:
    hostname: str     # also its network namespace's name
    address: str      # of its interface HOST_INTERFACE, in the cluster's subnet
    switch_port: str  # its veth peer's name, in the switch namespace


@dataclasses.dataclass(frozen=True)
class ClusterState:
    name: str
    subnet: str
    switch: str                  # the namespace holding the bridge every host is plugged into
    hosts: List[HostState]
    rate: Optional[str]          # tc rate of every host's link, both directions; None: unshaped
    owner_pid: Optional[int]     # None: kept until ``down`` (never reaped)
    owner_start: Optional[str]   # the owner's start time (/proc/PID/stat), against pid reuse
    launcher: str                # the script hydra runs instead of ssh
    origin: str = "api"          # "cli": made by ``python -m commlib.cluster up``

    @property
    def path(self) -> Path:
        return STATE_DIR / f"{self.name}.json"

    @property
    def namespaces(self) -> List[str]:
        return [host.hostname for host in self.hosts] + [self.switch]

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        os.replace(temporary, self.path)

    def host(self, name: str) -> HostState:
        """A host by hostname, or by its short name ``h0``, ``h1``..."""
        for host in self.hosts:
            if name in (host.hostname, host.hostname[len(self.name) + 1:]):
                return host
        raise ClusterError(f"cluster {self.name}: no host {name!r}; hosts: "
                           f"{', '.join(host.hostname for host in self.hosts)}")


def load_state(path: Path) -> ClusterState:
    data = json.loads(Path(path).read_text())
    data["hosts"] = [HostState(**host) for host in data["hosts"]]
    return ClusterState(**data)


def list_states() -> List[ClusterState]:
    states = []
    for path in sorted(STATE_DIR.glob("cl*.json")):
        try:
            states.append(load_state(path))
        except (OSError, ValueError, TypeError, KeyError):
            continue  # written by another version, or being replaced: not ours to judge
    return states


_process_lock = threading.RLock()
_depth = 0  # how deeply this process holds the lock file (a signal handler may nest inside)


@contextlib.contextmanager
def state_lock() -> Iterator[None]:
    """Exclusive across processes (a lock file); re-entrant within this one."""
    global _depth
    with _process_lock:
        if _depth:
            _depth += 1
            try:
                yield
            finally:
                _depth -= 1
            return
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        with open(STATE_DIR / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _depth = 1
            try:
                yield
            finally:
                _depth = 0
                fcntl.flock(lock, fcntl.LOCK_UN)


def process_start_time(pid: int) -> Optional[str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]  # field 22, counted after "pid (comm) "


def owner_alive(state: ClusterState) -> bool:
    if state.owner_pid is None:
        return True
    return process_start_time(state.owner_pid) == state.owner_start


def parse_rate(rate: str) -> int:
    """``"1gbit"``, ``"100mbit"``, ``"500kbit"`` (tc's units) -> bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", rate.strip().lower())
    if not match:
        raise ClusterError(f"rate {rate!r}: expected a number and a unit, e.g. 100mbit, 1gbit "
                           f"(units: {', '.join(_RATE_UNITS)})")
    bits = int(float(match.group(1)) * _RATE_UNITS[match.group(2)])
    if bits < 8000:
        raise ClusterError(f"rate {rate!r}: at least 8kbit")
    return bits


def check_request(hosts: int, *, rate: Optional[str], name: Optional[str]) -> None:
    """Raise ClusterError for a request that could never be made (before anything is touched)."""
    if not 1 <= hosts <= 200:
        raise ClusterError(f"{hosts} hosts: expected 1 to 200 (one /24 per cluster)")
    if rate is not None:
        parse_rate(rate)
    if name is not None and not NAME_PATTERN.match(name):
        raise ClusterError(f"cluster name {name!r}: expected 'cl' followed by 1-20 lowercase letters "
                           f"or digits (every namespace made here starts with 'cl')")


def new_state(hosts: int, *, rate: Optional[str], name: Optional[str], owner_pid: Optional[int],
              origin: str = "api") -> ClusterState:
    """Pick a name and a free subnet, and write the state file. Call under :func:`state_lock`."""
    check_request(hosts, rate=rate, name=name)
    taken = list_states()
    if name is None:
        name = "cl" + secrets.token_hex(4)
    if any(state.name == name for state in taken) or _namespaces_named(name):
        raise ClusterError(f"cluster name {name!r} is in use (a state file in {STATE_DIR} or a "
                           f"namespace {name}-*); pick another or run down --name {name}")
    subnet = _free_subnet({state.subnet for state in taken})
    addresses = list(subnet.hosts())
    owner_start = process_start_time(owner_pid) if owner_pid is not None else None
    if owner_pid is not None and owner_start is None:
        raise ClusterError(f"owner process {owner_pid} does not exist")
    state = ClusterState(
        name=name, subnet=str(subnet), switch=f"{name}-sw",
        hosts=[HostState(f"{name}-h{i}", str(addresses[i]), f"h{i}") for i in range(hosts)],
        rate=rate, owner_pid=owner_pid, owner_start=owner_start,
        launcher=str(STATE_DIR / f"{name}.launch"), origin=origin)
    state.save()
    return state


def _namespaces_named(name: str) -> List[str]:
    netns_dir = Path("/run/netns")
    if not netns_dir.is_dir():
        return []
    return [entry.name for entry in netns_dir.iterdir() if entry.name.startswith(name + "-")]


def _networks_on_this_machine() -> List[ipaddress.IPv4Network]:
    """Networks of the root namespace's addresses and routes (ours must not overlap them)."""
    networks = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        try:
            text = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for match in re.finditer(r"(?:inet |^)(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", text, re.M):
            try:
                network = ipaddress.IPv4Network(match.group(1), strict=False)
            except ValueError:
                continue
            if network.prefixlen >= 8:  # a catch-all route (a VPN's 0.0.0.0/1) holds no address
                networks.append(network)
    return networks


def _free_subnet(taken: set) -> ipaddress.IPv4Network:
    in_use = _networks_on_this_machine()
    candidates = list(SUBNET_POOL.subnets(new_prefix=24))
    random.shuffle(candidates)
    for subnet in candidates:
        if str(subnet) not in taken and not any(subnet.overlaps(network) for network in in_use):
            return subnet
    raise ClusterError(f"no free /24 left in {SUBNET_POOL} (clusters in {STATE_DIR}: {len(taken)})")


def describe(state: ClusterState) -> Dict[str, object]:
    """What ``list`` prints for one cluster."""
    owner = "kept until down" if state.owner_pid is None else (
        f"owner pid {state.owner_pid} ({'alive' if owner_alive(state) else 'gone'})")
    return {"name": state.name, "hosts": [f"{h.hostname} {h.address}" for h in state.hosts],
            "rate": state.rate or "unshaped", "owner": owner}
