"""The cluster tool itself (commlib.cluster): what up makes, that down removes all of it, that
two clusters at once stay apart, that a dead owner's cluster is reaped, that rate limits hold."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.mpirun import ROOT
from tests.support.multihost import make_cluster

from commlib.cluster.cluster import Cluster, ClusterError
from commlib.cluster.netns import namespace_exists
from commlib.cluster.state import STATE_DIR, parse_rate

pytestmark = pytest.mark.multihost

NET_RATE = Path(__file__).resolve().parents[1] / "support" / "net_rate.py"
CLI = [sys.executable, "-m", "commlib.cluster"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def namespaces():
    """Skip, saying why, where clusters cannot be made (not root, no ip)."""
    make_cluster(hosts=1).down()


def run(argv, timeout=60, **kwargs):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=str(ROOT), **kwargs)


def root_namespace_view():
    """What our clusters must never add to the machine's own namespace: links and addresses."""
    links = set(re.findall(r"^\d+: ([^:@]+)", run(["ip", "-o", "link", "show"]).stdout, re.M))
    addresses = set(re.findall(r"inet (\S+)", run(["ip", "-o", "-4", "addr", "show"]).stdout))
    return links, addresses


def assert_nothing_of_ours_in_the_root_namespace(state, links_before):
    """No link named like ours appeared there, no address of our subnet. (Other engineers' runs
    may add their own links meanwhile: only ours are looked for.)"""
    links, addresses = root_namespace_view()
    ours = {"br0", "eth0"} | {host["switch_port"] for host in state["hosts"]}
    assert not (links - links_before) & ours, f"links added to the machine's namespace: {links - links_before}"
    prefix = state["subnet"].rsplit(".", 1)[0] + "."
    assert not any(address.startswith(prefix) for address in addresses), addresses


def our_traces(name):
    namespaces = [entry for entry in os.listdir("/run/netns") if entry.startswith(name + "-")] \
        if os.path.isdir("/run/netns") else []
    files = [str(path) for path in STATE_DIR.glob(f"{name}.*")]
    return namespaces + files


def test_rates_and_names_are_checked_before_anything_is_made():
    assert parse_rate("100mbit") == 100_000_000 and parse_rate("1gbit") == 10**9
    for bad in ("fast", "100", "10 mbps", "1kbit"):
        with pytest.raises(ClusterError, match="rate"):
            parse_rate(bad)
    with pytest.raises(ClusterError, match="cluster name 'Web-1'"):
        Cluster(2, name="Web-1")
    with pytest.raises(ClusterError, match="0 hosts"):
        Cluster(0)


def test_without_the_privilege_up_says_why_and_makes_nothing():
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv (util-linux) to drop capabilities with")
    # uid 0 without any capability (an unprivileged container looks like this)
    result = run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", *CLI, "up", "2", "--name", "clnopriv"])
    assert result.returncode == 1, result
    assert "cannot make a cluster here" in result.stderr, result.stderr
    assert "Operation not permitted" in result.stderr or "needs root" in result.stderr, result.stderr
    assert our_traces("clnopriv") == []


def test_up_makes_hosts_with_own_names_and_down_removes_everything():
    links_before, _ = root_namespace_view()
    cluster = make_cluster(hosts=3, rate="100mbit")
    name = cluster.name
    try:
        state = json.loads((STATE_DIR / f"{name}.json").read_text())
        assert state["owner_pid"] == os.getpid() and len(state["hosts"]) == 3
        assert all(namespace_exists(ns) for ns in (*cluster.hostnames, f"{name}-sw"))
        for hostname, address in zip(cluster.hostnames, cluster.addresses):
            seen = cluster.exec(hostname, ["sh", "-c", "hostname; ip -4 -o addr show; tc qdisc show dev eth0"],
                                timeout=30).stdout
            assert seen.splitlines()[0] == hostname, seen
            assert f"inet {address}/24" in seen and "inet 127.0.0.1/8" in seen, seen  # loopback up
            assert re.search(r"qdisc tbf .* rate 100Mbit", seen), seen
        switch_side = run(["tc", "-n", f"{name}-sw", "qdisc", "show"]).stdout
        assert len(re.findall(r"qdisc tbf .* rate 100Mbit", switch_side)) == 3, switch_side  # what hosts receive
        # Host 0 reaches host 2 by its address (the bridge forwards).
        reached = cluster.exec("h0", [sys.executable, "-c", ("import socket, sys; s = socket.socket(); "
                                                             "s.settimeout(5); print(s.connect_ex((sys.argv[1], 9)))"),
                                      cluster.addresses[2]], timeout=30)
        assert reached.stdout.strip() == str(111), reached.stdout  # ECONNREFUSED: reached, nothing listens
        # One host's link turns slow and back, both ends, while the cluster stands.
        bad = run([*CLI, "limit", "--name", name, "h1", "fast"])
        assert bad.returncode == 1 and "rate 'fast'" in bad.stderr, bad
        for rate, shown in (("10mbit", "10Mbit"), ("none", "100Mbit")):
            assert run([*CLI, "limit", "--name", name, "h1", rate]).returncode == 0
            host_side = cluster.exec("h1", ["tc", "qdisc", "show", "dev", "eth0"], timeout=30).stdout
            switch_side = run(["tc", "-n", f"{name}-sw", "qdisc", "show"]).stdout
            assert re.search(rf"qdisc tbf .* rate {shown} ", host_side), host_side
            assert len(re.findall(rf"qdisc tbf .* rate {shown} ", switch_side)) == (1 if rate != "none" else 3), \
                switch_side
        assert_nothing_of_ours_in_the_root_namespace(state, links_before)
    finally:
        cluster.down()
    assert our_traces(name) == []
    cluster.down()  # idempotent
    assert run([*CLI, "down", "--name", name]).returncode == 0
    assert_nothing_of_ours_in_the_root_namespace(state, links_before)


def test_two_clusters_made_at_once_do_not_collide(namespaces):
    starts = [subprocess.Popen([*CLI, "up", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=ENV, cwd=str(ROOT)) for _ in range(2)]
    names = []
    try:
        for start in starts:
            out, err = start.communicate(timeout=60)
            assert start.returncode == 0, err
            names.append(out.strip())
        first, second = (Cluster.attach(name) for name in names)
        assert first.name != second.name
        assert first.state.subnet != second.state.subnet
        # Each cluster is its own network: host 0 of one cannot reach host 1 of the other.
        probe = "import socket, sys; s = socket.socket(); s.settimeout(2); print(s.connect_ex((sys.argv[1], 9)))"
        own = first.exec("h0", [sys.executable, "-c", probe, first.addresses[1]], timeout=30).stdout.strip()
        other = first.exec("h0", [sys.executable, "-c", probe, second.addresses[1]], timeout=30).stdout.strip()
        assert own == "111" and other != "111", (own, other)  # refused (reached) vs unreachable
    finally:
        for name in names:
            run([*CLI, "down", "--name", name])
    assert all(our_traces(name) == [] for name in names)


def test_a_killed_owners_cluster_is_reaped_by_the_next_up(namespaces):
    owner = subprocess.Popen([sys.executable, "-c", ("import sys, time; from commlib.cluster import Cluster; "
                                                     "c = Cluster(2); print(c.name, flush=True); time.sleep(600)")],
                             stdout=subprocess.PIPE, text=True, env=ENV, cwd=str(ROOT))
    try:
        name = owner.stdout.readline().strip()
        assert name.startswith("cl"), name
    finally:
        owner.kill()
        owner.wait(timeout=30)
    assert our_traces(name), "SIGKILL left no chance to clean up: the cluster must still be there"
    with make_cluster(hosts=1) as fresh:
        assert our_traces(name) == [], f"{name} of a dead owner survived {fresh.name}'s up"


def test_cli_up_with_an_owner_is_reaped_once_the_owner_is_gone(namespaces):
    owner = subprocess.Popen(["sleep", "300"])
    try:
        made = run([*CLI, "up", "1", "--owner", str(owner.pid)])
        assert made.returncode == 0, made.stderr
        name = made.stdout.strip()
        with make_cluster(hosts=1):
            assert our_traces(name), "its owner is alive: it must stay"
    finally:
        owner.kill()
        owner.wait(timeout=30)
    with make_cluster(hosts=1):
        assert our_traces(name) == []


def test_a_terminated_owner_removes_its_cluster(namespaces):
    owner = subprocess.Popen([sys.executable, "-c", ("import sys, time; from commlib.cluster import Cluster; "
                                                     "c = Cluster(2); print(c.name, flush=True); time.sleep(600)")],
                             stdout=subprocess.PIPE, text=True, env=ENV, cwd=str(ROOT))
    name = owner.stdout.readline().strip()
    assert our_traces(name)
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=30) == -signal.SIGTERM
    assert our_traces(name) == []


def test_cli_run_places_ranks_on_hosts_and_returns_mpiexecs_status(namespaces):
    name = run([*CLI, "up", "2"]).stdout.strip()
    try:
        shown = run([*CLI, "run", "--name", name, "-n", "4", "-ppn", "2", "--", "hostname"])
        assert shown.returncode == 0, shown
        assert sorted(shown.stdout.split()) == sorted([f"{name}-h0"] * 2 + [f"{name}-h1"] * 2), shown.stdout
        failed = run([*CLI, "run", "--name", name, "-n", "2", "-ppn", "1", "--", "sh", "-c", "exit 3"])
        assert failed.returncode == 3, failed
    finally:
        assert run([*CLI, "down", "--name", name]).returncode == 0
    assert our_traces(name) == []


def measure_rate(cluster, sender, receiver, port, nbytes):
    listener = cluster.popen(receiver, [sys.executable, str(NET_RATE), "receive", str(port), str(nbytes)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert listener.stdout.readline().strip() == "LISTENING"
        cluster.exec(sender, [sys.executable, str(NET_RATE), "send", cluster.state.host(receiver).address,
                              str(port), str(nbytes)], timeout=60)
        out, _ = listener.communicate(timeout=60)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()
    found = re.search(r"MBIT/S ([\d.]+)", out)
    assert found, out
    return float(found.group(1))


def test_a_rate_limit_holds_in_both_directions():
    with make_cluster(hosts=2, rate="100mbit") as cluster:
        # 8 MB at 100 Mbit/s: about 0.7 s; the bucket (64 KiB) and TCP's ramp-up are noise.
        forward = measure_rate(cluster, "h0", "h1", 5001, 8 * 10**6)
        backward = measure_rate(cluster, "h1", "h0", 5002, 8 * 10**6)
    assert 50 <= forward <= 110 and 50 <= backward <= 110, (forward, backward)
