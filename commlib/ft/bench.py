"""``python -m commlib.ft.bench``: what fault tolerance costs, beside its peer in the same run.

    python -m commlib.ft.bench --replicas 3 --steps 60 --bytes 4M --compute-ms 20 --state 100M

Two tables, processes on this host over the socket transport (loopback):

* **steady state**: per step, ``compute`` (emulated by a sleep: the accelerator's time) then the
  average of a ``bytes`` gradient over the replicas. *plain*: a fixed group
  (``commlib.group_over_store``) and its ring allreduce. *ft*: the same allreduce through a
  :class:`commlib.ft.Manager` (the step's vote, a second allreduce of two integers, and the
  epoch check). Medians over the steps after a warm-up; the ratio is ft / plain.
* **catch-up**: a replica joins a running job whose state is ``state`` bytes; the joiner's
  catch-up (allgather of the steps, header, payload, SHA-256 both ends, loading) against a plain
  broadcast of the same bytes over a group of the same members (the wire as the sockets give it
  here), and against the time the bytes take at 1 Gbit/s.

With ``--hosts N --rate 1gbit`` (root: :mod:`commlib.cluster` makes the hosts) it measures the
catch-up across namespaced hosts instead, one member per host, each link shaped to ``rate``:
every repeat builds a fresh group (as a quorum does), the last host catches up from the first
(:func:`commlib.ft.catchup.catch_up`, the transfer only: no coordinator), then the same bytes
are broadcast over that group, against the wire time at ``rate``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from typing import List, Optional

import numpy as np

from commlib.units import format_bytes, parse_size

__all__ = ["main"]

_BLOCK = 5  # steps of one kind before switching to the other


class _RawCodec:
    """The bench's state is one byte array: encoded as its bytes, nothing else."""

    @staticmethod
    def encode(objects) -> memoryview:
        return memoryview(objects["model"])

    @staticmethod
    def decode(data) -> dict:
        return {"model": np.frombuffer(data, np.uint8)}  # the received buffer itself


def _steady_replica(rank: int, size: int, port: int, nbytes: int, rounds: int, compute_s: float, queue) -> None:
    """Alternate blocks of plain and fault-tolerant steps in one process, so the machine's load
    drifts over both alike."""
    import dataclasses

    from commlib.config import load_config
    from commlib.ft import Manager
    from commlib.runtime import group_over_store

    manager = Manager(f"127.0.0.1:{port}", f"r{rank}", timeout=120)
    manager.start_step()  # the quorum first, then the plain group over the same store
    config = dataclasses.replace(load_config(), shm=False, crash_witness=False)
    plain = group_over_store(manager.store, rank, size, timeout=120, name="plain", prefix="bench/plain",
                             config=config)
    grads = np.ones(nbytes // 4, np.float32)
    times: dict = {"plain": [], "ft": []}
    for _ in range(rounds):
        for _ in range(_BLOCK):
            started = time.perf_counter()
            time.sleep(compute_s)
            plain.allreduce(grads, algorithm="ring")
            np.divide(grads, np.float32(size), out=grads)
            times["plain"].append(time.perf_counter() - started)
        for _ in range(_BLOCK):
            started = time.perf_counter()
            manager.start_step()
            time.sleep(compute_s)
            manager.allreduce_average(grads)
            if manager.should_commit():
                times["ft"].append(time.perf_counter() - started)
    plain.close()
    queue.put(("steady", rank, times))
    manager.close()


def _ft_replica(rank: int, port: int, state_bytes: int, steps: int, hold: Optional[str], queue) -> None:
    from commlib.ft import Manager, keys

    manager = Manager(f"127.0.0.1:{port}", f"r{rank}", timeout=120)
    state = {"model": np.full(state_bytes, rank + 1, np.uint8)}
    manager.codec = _RawCodec()
    manager.register_state("model", lambda: state["model"], lambda loaded: state.update(model=loaded))
    grads = np.ones(1024, np.float32)
    while manager.steps < steps:
        if hold and manager.steps == steps // 2:
            # The joiner enters a running job: wait until it is there and this replica's heartbeat
            # has seen the epoch close for it (so the next step is the epoch's last).
            while not (os.path.exists(hold) and manager.heartbeat.watched(keys.closed(manager.epoch))):
                time.sleep(0.01)
        manager.start_step()
        manager.allreduce_average(grads)
        manager.should_commit()
    catch_ups = [event for event in manager.events if event["kind"] == "quorum" and event["catch_up_bytes"]]
    queue.put(("ft", rank, [], catch_ups, bool(np.all(state["model"] == 1))))
    manager.close()


def _broadcast_replica(rank: int, size: int, port: int, nbytes: int, repeats: int, queue) -> None:
    import dataclasses

    from commlib.config import load_config
    from commlib.rendezvous import TCPStore
    from commlib.runtime import group_over_store

    store = TCPStore("127.0.0.1", port, None, timeout=120)
    config = dataclasses.replace(load_config(), shm=False, crash_witness=False)
    group = group_over_store(store, rank, size, timeout=120, name="bcast", prefix="bench/bcast", config=config)
    buffer = np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        group.broadcast(buffer, root=0)
        times.append(time.perf_counter() - started)
    group.close()
    store.close()
    queue.put(("bcast", rank, times))


def _hosts_member(rank: int, size: int, store_address: str, state_bytes: int, repeats: int) -> None:
    """One member of the cross-host catch-up (``--member``): prints its times as one JSON line."""
    import dataclasses
    import json

    from commlib.config import load_config
    from commlib.ft.catchup import catch_up
    from commlib.rendezvous import TCPStore, TCPStoreServer
    from commlib.runtime import group_over_store

    host, port = store_address.rsplit(":", 1)
    server = TCPStoreServer("0.0.0.0", int(port)).start() if rank == 0 else None
    store = TCPStore(host, int(port), None, timeout=120)
    # the hosts' link, not loopback or the switch's other addresses (see commlib.cluster)
    config = dataclasses.replace(load_config(), shm=False, crash_witness=False, socket_interface="eth0")
    state = np.full(state_bytes, 1 if rank < size - 1 else 0, np.uint8)
    received: dict = {}
    times: dict = {"catchup": [], "bcast": []}
    for repeat in range(repeats):
        group = group_over_store(store, rank, size, timeout=120, name=f"catchup{repeat}",
                                 prefix=f"bench/hosts/{repeat}", config=config)
        steps = 1 if rank == size - 1 else 2
        result = catch_up(group, steps, lambda: ({}, state.data),
                          lambda ledger, payload: received.update(ok=bool(np.all(np.frombuffer(payload, np.uint8)))))
        times["catchup"].append(result.transfer_seconds)
        group.barrier()
        started = time.perf_counter()
        group.broadcast(state, root=0)
        times["bcast"].append(time.perf_counter() - started)
        group.close()
    store.close()
    print(json.dumps({"rank": rank, "times": times, "intact": received.get("ok", rank != size - 1)}), flush=True)
    if server is not None:
        time.sleep(1.0)  # the others' last requests
        server.close()


def _across_hosts(args, state_bytes: int) -> int:
    import json
    import subprocess

    from commlib.cluster import Cluster
    from commlib.cluster.state import parse_rate

    repeats, timeout = 5, 600.0
    with Cluster(args.hosts, rate=args.rate) as cluster:
        store = f"{cluster.addresses[0]}:29640"
        env = dict(os.environ, MPI4PY_RC_INITIALIZE="0")
        members = [cluster.popen(host, [sys.executable, "-m", "commlib.ft.bench", "--member", str(rank),
                                        "--hosts", str(args.hosts), "--store", store, "--state", args.state,
                                        "--repeats", str(repeats)],
                                 stdout=subprocess.PIPE, text=True, env=env)
                   for rank, host in enumerate(cluster.hostnames)]
        outputs = [member.communicate(timeout=timeout)[0] for member in members]
    if any(member.returncode for member in members):
        sys.stderr.write("\n".join(outputs))
        return 1
    results = [json.loads(output.strip().splitlines()[-1]) for output in outputs]

    def slowest(kind: str) -> List[float]:  # per repeat, the member that finished last
        return [max(result["times"][kind][repeat] for result in results) for repeat in range(repeats)]

    catch_s = statistics.median(results[-1]["times"]["catchup"])
    bcast_s = statistics.median(slowest("bcast"))
    wire_s = state_bytes * 8 / parse_rate(args.rate)
    intact = all(result["intact"] for result in results)
    print(f"# catch-up across {args.hosts} namespaced hosts, links shaped to {args.rate} (tc tbf), one member each: "
          f"the last host takes {format_bytes(state_bytes)} from the first, in a fresh group; then a plain "
          f"broadcast of the same bytes over that group; medians of {repeats}; the state arrived intact: {intact}")
    print(f"{'bytes':>10} {'catchup_s':>9} {'bcast_s':>8} {'catchup/bcast':>13} {'wire_s':>8} {'catchup/wire':>12}")
    print(f"{state_bytes:>10} {catch_s:>9.3f} {bcast_s:>8.3f} {catch_s / bcast_s:>13.2f} {wire_s:>8.3f} "
          f"{catch_s / wire_s:>12.2f}")
    if args.json:
        from commlib.bench.record import bench_record, write_record

        record = bench_record("commlib.ft.bench", argv=[], world_size=args.hosts,
                              columns=["bytes", "catchup_s", "bcast_s", "catchup/bcast", "wire_s", "catchup/wire"],
                              rows=[{"bytes": state_bytes, "catchup_s": catch_s, "bcast_s": bcast_s,
                                     "catchup/bcast": catch_s / bcast_s, "wire_s": wire_s,
                                     "catchup/wire": catch_s / wire_s}],
                              notes=f"{args.hosts} namespaced hosts, one member each, links shaped to {args.rate}; "
                                    f"catch-up in a fresh group, then a broadcast in it; medians of {repeats}")
        record["command"] = "python -m commlib.ft.bench " + " ".join(sys.argv[1:])
        write_record(f"{args.json}-hosts.json", record)
    return 0 if intact else 1


def _collect(queue, processes, count: int, timeout: float) -> List[tuple]:
    results = [queue.get(timeout=timeout) for _ in range(count)]
    for process in processes:
        process.join(timeout)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8, help=f"blocks of {_BLOCK} plain and {_BLOCK} ft steps")
    parser.add_argument("--bytes", default="4M", help="gradient bytes per step")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="emulated compute per step")
    parser.add_argument("--state", default="100M", help="state bytes a joiner catches up")
    parser.add_argument("--json", help="write the tables as commlib-bench/1 records: PATH-steady.json, "
                                       "PATH-catchup.json")
    parser.add_argument("--hosts", type=int, help="measure the catch-up across this many namespaced hosts")
    parser.add_argument("--rate", default="1gbit", help="with --hosts: every host's link (tc units)")
    parser.add_argument("--member", type=int, help=argparse.SUPPRESS)  # one host's process of --hosts
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.member is not None:
        _hosts_member(args.member, args.hosts, args.store, parse_size(args.state), args.repeats)
        return 0
    if args.hosts:
        return _across_hosts(args, parse_size(args.state))
    return _on_one_host(args, "python -m commlib.ft.bench " + " ".join(argv if argv is not None else sys.argv[1:]))


def _steady_state(args, context, queue, nbytes: int, timeout: float) -> tuple:
    """(plain ms, ft ms): medians over every replica's steps after each kind's first block."""
    from commlib.ft.coordinator import Coordinator

    coordinator = Coordinator("127.0.0.1", 0, initial_replicas=args.replicas, grace=0.0).start()
    processes = [context.Process(target=_steady_replica, args=(rank, args.replicas, coordinator.port, nbytes,
                                                               args.rounds, args.compute_ms / 1e3, queue))
                 for rank in range(args.replicas)]
    for process in processes:
        process.start()
    steady = _collect(queue, processes, args.replicas, timeout)
    coordinator.close()

    def median_ms(kind: str) -> float:  # the first block of each kind warms up
        return 1e3 * statistics.median(t for result in steady for t in result[2][kind][_BLOCK:])

    return median_ms("plain"), median_ms("ft")


def _joiner_catch_up(args, context, queue, state_bytes: int, timeout: float) -> tuple:
    """(the joiner's catch-up seconds, whether its state arrived intact): replicas - 1 train; at
    half the steps they hold until the joiner heartbeats."""
    from commlib.ft.coordinator import Coordinator

    hold = f"/tmp/commlib-ft-bench-{os.getpid()}.hold"
    coordinator = Coordinator("127.0.0.1", 0, initial_replicas=args.replicas - 1, grace=0.0).start()
    processes = [context.Process(target=_ft_replica, args=(rank, coordinator.port, state_bytes, 20, hold, queue))
                 for rank in range(args.replicas - 1)]
    for process in processes:
        process.start()
    while len(coordinator.quorums) < 1:
        time.sleep(0.05)
    joiner = context.Process(target=_ft_replica, args=(args.replicas - 1, coordinator.port, state_bytes, 20, None,
                                                       queue))
    joiner.start()
    while len(coordinator.replicas) < args.replicas:
        time.sleep(0.05)
    open(hold, "w").close()
    joined = _collect(queue, processes + [joiner], args.replicas, timeout)
    os.unlink(hold)
    coordinator.close()
    _, _, _, transfers, caught = {result[1]: result for result in joined}[args.replicas - 1]
    return (transfers[0]["transfer_s"] if transfers else float("nan")), caught


def _plain_broadcast(args, context, queue, state_bytes: int, timeout: float) -> float:
    """The median over 3 repeats of the slowest member's broadcast of ``state_bytes``."""
    from commlib.rendezvous import TCPStoreServer

    server = TCPStoreServer("127.0.0.1", 0).start()
    processes = [context.Process(target=_broadcast_replica, args=(rank, args.replicas, server.port, state_bytes, 3,
                                                                  queue)) for rank in range(args.replicas)]
    for process in processes:
        process.start()
    bcast = _collect(queue, processes, args.replicas, timeout)
    server.close()
    return statistics.median(max(result[2][repeat] for result in bcast) for repeat in range(3))


def _on_one_host(args, command: str) -> int:
    nbytes, state_bytes = parse_size(args.bytes), parse_size(args.state)
    context = multiprocessing.get_context("spawn")
    os.environ["MPI4PY_RC_INITIALIZE"] = "0"
    queue = context.Queue()
    timeout = 600.0

    plain_ms, ft_ms = _steady_state(args, context, queue, nbytes, timeout)
    steps = (args.rounds - 1) * _BLOCK
    print(f"# steady state: {args.replicas} replicas, {format_bytes(nbytes)} gradient, {args.compute_ms:g} ms "
          f"compute (sleep), sockets on loopback, median over {steps} steps x replicas of each kind, interleaved")
    print(f"{'replicas':>8} {'bytes':>10} {'compute_ms':>10} {'plain_ms':>9} {'ft_ms':>9} {'ft/plain':>8}")
    print(f"{args.replicas:>8} {nbytes:>10} {args.compute_ms:>10.1f} {plain_ms:>9.2f} {ft_ms:>9.2f} "
          f"{ft_ms / plain_ms:>8.3f}")

    catch_up_s, caught = _joiner_catch_up(args, context, queue, state_bytes, timeout)
    bcast_s = _plain_broadcast(args, context, queue, state_bytes, timeout)
    wire_s = state_bytes * 8 / 1e9
    print(f"\n# catch-up: a joiner takes {format_bytes(state_bytes)} from a live peer ({args.replicas} members); "
          f"plain broadcast of the same bytes, same members, same sockets; the state arrived intact: {caught}")
    print(f"{'bytes':>10} {'catchup_s':>9} {'bcast_s':>8} {'catchup/bcast':>13} {'1Gbit_s':>8} {'catchup/1Gbit':>13}")
    print(f"{state_bytes:>10} {catch_up_s:>9.3f} {bcast_s:>8.3f} {catch_up_s / bcast_s:>13.2f} {wire_s:>8.3f} "
          f"{catch_up_s / wire_s:>13.2f}")
    if args.json:
        from commlib.bench.record import bench_record, write_record

        steady_record = bench_record(
            "commlib.ft.bench", argv=[], world_size=args.replicas,
            columns=["replicas", "bytes", "compute_ms", "plain_ms", "ft_ms", "ft/plain"],
            rows=[{"replicas": args.replicas, "bytes": nbytes, "compute_ms": args.compute_ms, "plain_ms": plain_ms,
                   "ft_ms": ft_ms, "ft/plain": ft_ms / plain_ms}],
            notes="steady state; compute emulated by a sleep; sockets on loopback")
        catch = bench_record("commlib.ft.bench", argv=[], world_size=args.replicas,
                             columns=["bytes", "catchup_s", "bcast_s", "catchup/bcast", "1Gbit_s", "catchup/1Gbit"],
                             rows=[{"bytes": state_bytes, "catchup_s": catch_up_s, "bcast_s": bcast_s,
                                    "catchup/bcast": catch_up_s / bcast_s, "1Gbit_s": wire_s,
                                    "catchup/1Gbit": catch_up_s / wire_s}],
                             notes="a joiner's catch-up from a live peer; sockets on loopback")
        for record, suffix in ((steady_record, "steady"), (catch, "catchup")):
            record["command"] = command
            write_record(f"{args.json}-{suffix}.json", record)
    return 0

if __name__ == "__main__":
    sys.exit(main())
