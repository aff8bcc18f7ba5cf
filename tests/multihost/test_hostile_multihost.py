"""Issue 30's hostile host: a job runs across two hosts (namespaces), a third host attacks every
port the job's commlib code listens on (found with ``ss``) with random bytes, truncated
handshakes, a handshake replayed from a real rank, another job's secret, a 100 GB frame and
1,000 idle connections; the job's collectives stay exact, it exits 0, each stranger is logged,
and the listeners' memory stays flat. The job: tests/multihost/hostile_multihost_ranks.py; the stranger:
tests/support/strangers.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commlib.cluster.state import HOST_INTERFACE
from commlib.rendezvous.handshake_core import RESPONSE_BYTES
from tests.support.launch import LAUNCH_SCRIPTS, base_env, kill_tree
from tests.support.mpirun import ROOT, child_environment
from tests.support.multihost import make_cluster, processes_on_hosts

pytestmark = [pytest.mark.multihost]

JOB = Path(__file__).with_name("hostile_multihost_ranks.py")
RSS_SLACK_KIB = 16 << 10  # what 1,000 refused connections may leave behind in a listener: nothing much


@pytest.fixture(scope="module")
def cluster():
    with make_cluster(hosts=3) as made:
        yield made


def wait_file(path: Path, job: subprocess.Popen, seconds: float = 180.0) -> Path:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if job.poll() is not None:
            pytest.fail(f"the job ended (exit {job.returncode}) before {path.name} appeared")
        if time.monotonic() > deadline:
            pytest.fail(f"{path.name} did not appear within {seconds:g} s")
        time.sleep(0.1)
    return path


def listening(cluster, host: str):
    """``[(address, port, pid, name)]``: what ``ss -ltnp`` shows on ``host``."""
    output = cluster.exec(host, ["ss", "-ltnpH"], timeout=30).stdout
    found = []
    for line in output.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        address, port = fields[3].rsplit(":", 1)
        owner = re.search(r'\("([^"]+)",pid=(\d+)', line)
        found.append((address.strip("[]"), int(port), int(owner.group(2)) if owner else -1,
                      owner.group(1) if owner else "?"))
    return found


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def attack(cluster, stranger: str, endpoints, *extra: str) -> dict:
    argv = [sys.executable, "-m", "tests.support.strangers", "attack", *endpoints, *extra]
    result = subprocess.run(_host_argv(cluster, stranger, argv), capture_output=True, text=True, timeout=240,
                            env=child_environment(), cwd=str(ROOT))
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _host_argv(cluster, host, argv):
    from commlib.cluster.netns import host_argv

    return host_argv(cluster.state, host, argv)


@pytest.mark.mpi
def test_a_third_host_attacks_every_listening_port_of_an_mpi_job_and_it_stays_exact(cluster, tmp_path):
    job_host, peer_host, stranger = cluster.hostnames
    stranger_address = cluster.addresses[2]
    folder = tmp_path
    os.chmod(folder, 0o755)
    log = open(folder / "job.log", "w")
    argv = [sys.executable, str(JOB), str(folder)]
    job = subprocess.Popen(cluster.mpiexec_argv(2, 1, argv, hosts=[job_host, peer_host]), stdout=log,
                           stderr=subprocess.STDOUT, env=child_environment(), cwd=str(ROOT), start_new_session=True)
    sniffer = None
    try:
        ranks = [json.loads(wait_file(folder / f"rank{rank}.json", job).read_text()) for rank in range(2)]
        rank_pids = {info["pid"] for info in ranks}
        # Phase 1: the witnesses' query ports, while the job runs allreduces.
        ports = {host: listening(cluster, host) for host in (job_host, peer_host)}
        witness_ports = []
        for info in ranks:
            assert info["witness"], f"rank on {info['host']} has no witness query port: {info}"
            addresses, port = info["witness"].rsplit(":", 1)
            witness_ports.append((info["host"], addresses.split(","), int(port)))
        commlib_listeners, witness_pids = [], set()
        for host, addresses, port in witness_ports:
            found = [entry for entry in ports[host] if entry[1] == port]
            assert found, f"ss shows no listener at the witness's port {port} on {host}: {ports[host]}"
            for address, _, pid, _ in found:
                assert address in addresses, f"the witness listens on {address}, not only {addresses}"
                assert parent_of(pid) in rank_pids, f"port {port} on {host} is not the job's witness"
                witness_pids.add(pid)
                commlib_listeners.append(f"witness@{address}:{port}")
        others = [entry for host in ports for entry in ports[host]
                  if entry[2] not in witness_pids]
        print(f"listening besides commlib's (MPI's launcher and netmod): {others}", flush=True)
        watched = sorted(rank_pids | witness_pids)
        before = {pid: rss_kib(pid) for pid in watched}
        report = attack(cluster, stranger, commlib_listeners, "--idle", "1000", "--hold", "3")
        after = {pid: rss_kib(pid) for pid in watched}
        (folder / "stop-steady").write_text("1")
        for endpoint in commlib_listeners:
            outcome = report[endpoint]
            assert outcome["another job's secret"] == "refused: another job's secret", outcome
            for attack_name in ("random bytes", "100 GB frame"):
                assert outcome[attack_name] in ("refused: not a commlib handshake", "closed"), outcome
            assert outcome["truncated response"] in ("closed", "refused: not a commlib handshake"), outcome
        assert report["idle"]["opened"] + report["idle"]["failed"] == 1000, report["idle"]
        for pid in watched:
            assert after[pid] - before[pid] < RSS_SLACK_KIB, (pid, before[pid], after[pid])
        # Phase 2: the socket transport's mesh listener on rank 0, its last rank held back. The
        # last rank's handshake is captured on its host's interface as it joins, for phase 3.
        mesh = json.loads(wait_file(folder / "listening-1.json", job).read_text())
        mesh_port = mesh[0][1]
        assert any(entry[1] == mesh_port and entry[2] in rank_pids for entry in listening(cluster, job_host))
        mesh_endpoints = [f"transport@{address}:{port}" for address, port in mesh]
        report_mesh = attack(cluster, stranger, mesh_endpoints, "--idle", "200", "--hold", "1")
        for endpoint in mesh_endpoints:
            assert report_mesh[endpoint]["another job's secret"] == "refused: another job's secret", report_mesh
        captured = folder / "captured.json"
        sniffer = subprocess.Popen(_host_argv(cluster, peer_host, [
            sys.executable, "-m", "tests.support.strangers", "sniff", HOST_INTERFACE, str(mesh_port), "8",
            str(captured), "--ready", str(folder / "sniffing")]), env=child_environment(), cwd=str(ROOT))
        wait_file(folder / "sniffing", job, 60)
        (folder / "go-1").write_text("1")
        assert sniffer.wait(timeout=60) == 0
        flows = json.loads(captured.read_text())
        rank_flows = [bytes.fromhex(data) for flow, data in flows.items() if len(data) >= 2 * RESPONSE_BYTES]
        assert rank_flows, f"no handshake captured from the last rank: {flows}"
        replay = rank_flows[0][:RESPONSE_BYTES]
        # Phase 3: the p2p channel's mesh: the captured response replayed at it.
        p2p_mesh = json.loads(wait_file(folder / "listening-2.json", job).read_text())
        p2p_endpoints = [f"transport@{address}:{port}" for address, port in p2p_mesh]
        report_p2p = attack(cluster, stranger, p2p_endpoints, "--replay", replay.hex())
        for endpoint in p2p_endpoints:
            assert report_p2p[endpoint]["replayed response"] == \
                "refused: a wrong MAC (a forged or replayed handshake)", report_p2p
        (folder / "go-2").write_text("1")
        returncode = job.wait(timeout=240)
    finally:
        for process in (job, sniffer):
            if process is not None and process.poll() is None:
                os.killpg(job.pid, 9) if process is job else process.kill()
                process.wait()
        log.close()
    output = (folder / "job.log").read_text()
    assert returncode == 0 and "OK:" in output, output[-6000:]
    refused = [line for line in output.splitlines() if "refused" in line and stranger_address in line]
    for service in ("crash witness on", "socket transport (group 'world')", "socket transport (group 'world/p2p')"):
        assert any(service in line for line in refused), (service, refused[:20])
    print("\n".join(["the job logged:", *refused]), flush=True)
    assert any("a wrong MAC (a forged or replayed handshake)" in line for line in refused), refused
    assert sum("crash witness on" in line and "the oldest made room" in line for line in refused) == 2, refused
    print(f"RSS KiB before/after the witnesses' attack: {[(before[pid], after[pid]) for pid in watched]}", flush=True)
    assert len(refused) < 60, f"strangers logged once per kind, not per connection: {len(refused)} lines"
    assert processes_on_hosts(cluster) == {}


def _torchrun(cluster, host: str, node: int, mode: str, rdzv_id: str, env: dict) -> subprocess.Popen:
    argv = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addresses[0]}:29756",
            "--rdzv-id", rdzv_id, str(LAUNCH_SCRIPTS / "launch_ranks.py"), mode]
    return cluster.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=base_env(env), cwd=str(ROOT), start_new_session=True)


def _finish(processes, seconds: float):
    outputs = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            for other in processes:
                kill_tree(other.pid)
            pytest.fail("torchrun on two hosts hung")
        outputs.append((process.returncode, output))
    return outputs


def test_a_third_host_attacks_a_torchrun_job_over_sockets_and_it_stays_exact(cluster, tmp_path):
    job_host, peer_host, stranger = cluster.hostnames
    stranger_address = cluster.addresses[2]
    os.chmod(tmp_path, 0o755)
    env = {"HOSTILE_DIR": str(tmp_path), "COMMLIB_JOB_SECRET": "the hostile torchrun job's own secret"}
    processes = [_torchrun(cluster, host, node, "hostile", f"{cluster.name}-hostile", env)
                 for node, host in enumerate((job_host, peer_host))]
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"rank{rank}.json").exists() for rank in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), "the job never started"
            time.sleep(0.1)
        ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
        rank_pids = {info["pid"] for info in ranks}
        endpoints, owners, others = [], set(), []
        for host in (job_host, peer_host):
            mine = [info for info in ranks if info["host"] == host]
            witness_port = int(mine[0]["witness"].rsplit(":", 1)[1]) if mine and mine[0]["witness"] else -1
            store_ports = {info["store_port"] for info in mine if info["store_port"]}
            for address, port, pid, name in listening(cluster, host):
                if port == witness_port and parent_of(pid) in rank_pids:
                    endpoints.append(f"witness@{address}:{port}")
                elif port in store_ports and pid in rank_pids:
                    endpoints.append(f"store@{address}:{port}")
                elif pid in rank_pids:
                    pytest.fail(f"a rank listens on {address}:{port} on {host}, and it is neither the witness's "
                                f"query port nor the store")
                else:
                    others.append((host, address, port, name))
                    continue
                owners.add(pid)
        print(f"listening besides commlib's (torchrun's agent and its c10d store): {others}", flush=True)
        assert sum(e.startswith("witness@") for e in endpoints) == 2 and any(e.startswith("store@") for e in endpoints)
        watched = sorted(owners | rank_pids)
        before = {pid: rss_kib(pid) for pid in watched}
        report = attack(cluster, stranger, endpoints, "--idle", "1000", "--hold", "3")
        after = {pid: rss_kib(pid) for pid in watched}
        (tmp_path / "stop").write_text("1")
        outputs = _finish(processes, 240)
    finally:
        for process in processes:
            if process.poll() is None:
                kill_tree(process.pid)
    everything = "\n".join(output for _, output in outputs)
    assert all(code == 0 for code, _ in outputs), everything[-6000:]
    assert sorted(re.findall(r"rank (\d+): \d+ checks OK", everything)) == ["0", "1"], everything[-4000:]
    for endpoint in endpoints:
        assert report[endpoint]["another job's secret"] == "refused: another job's secret", report
        assert report[endpoint]["random bytes"] in ("refused: not a commlib handshake", "closed"), report
    print(f"RSS KiB before/after (ranks {sorted(rank_pids)}, listeners {sorted(owners)}): "
          f"{[(pid, before[pid], after[pid]) for pid in watched]}", flush=True)
    # Bounded: the ranks (their steady loop reuses its buffers: see launch_ranks.hostile) and the
    # witnesses.
    for pid in watched:
        assert after[pid] - before[pid] < RSS_SLACK_KIB, (pid, before[pid], after[pid])
    refused = [line for line in everything.splitlines() if "refused" in line and stranger_address in line]
    print("\n".join(["the job logged:", *refused]), flush=True)
    assert any("crash witness on" in line for line in refused) and any("store server" in line for line in refused)
    assert len(refused) < 60, len(refused)
    assert processes_on_hosts(cluster) == {}


def test_a_torchrun_node_with_another_jobs_secret_cannot_join_and_both_sides_say_why(cluster, tmp_path):
    processes = [_torchrun(cluster, host, node, "init", f"{cluster.name}-secrets",
                           {"COMMLIB_JOB_SECRET": secret, "COMMLIB_TIMEOUT": "20"})
                 for node, (host, secret) in enumerate(zip(cluster.hostnames[:2],
                                                           ("this job's secret, node 0", "another job's, node 1")))]
    outputs = _finish(processes, 240)
    assert all(code != 0 for code, _ in outputs), [output[-3000:] for _, output in outputs]
    # The store (rank 0's) refuses the other job's rank: that rank cannot connect, and rank 0's
    # wait for it ends naming it and what the store refused.
    waited = [output for _, output in outputs if "CommTimeoutError" in output and "rank 1 did not arrive" in output]
    refused = [output for _, output in outputs if "AuthenticationError" in output]
    assert len(waited) == 1 and "the store refused meanwhile" in waited[0] and "another job's secret" in waited[0], \
        [output[-3000:] for _, output in outputs]
    assert len(refused) == 1 and "another job's secret" in refused[0], refused[0][-3000:] if refused else outputs
    assert processes_on_hosts(cluster) == {}
