"""``mpiexec -n P python -m commlib.costmodel fit [--out FILE]``: measure the links, write a model.

Every measurement goes through commlib's own MPI transport (post/wait, as the schedules use it),
so ``alpha`` includes our Python per-step cost, not only the library's. Ranks not measuring wait
in a sleeping barrier, so they leave the cores to the pair that is.

* ``intra``: two ranks of one host exchange ``m`` bytes both ways at once, for several ``m``;
  ``alpha`` is the smallest exchange's median time, ``beta`` the slope between the two largest.
* ``inter``: the first ranks of the first two hosts, the same way; ``host_beta``: every local
  rank of host 0 exchanges with the same local rank of host 1 at once (the host's link shared,
  as in hierarchical's cross phase), seconds per byte leaving one host.
* ``gamma``: every rank reduces 1 MiB float32 segments at once (the cores shared as in a
  collective), seconds per byte.
* ``native_alpha``: an 8-byte ``native`` allreduce through the group; ``call_overhead``: what an
  8-byte call of each schedule costs beyond its modelled steps (Python's share: planning, views,
  the group's path), added to that schedule's predictions.

Short: about a second on one host, a few across a 1 Gbit/s link.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Dict

import numpy as np

__all__ = ["main", "fit", "measure", "model_from"]

SIZES = (8, 1 << 10, 1 << 16, 1 << 20, 4 << 20)
REPEATS = 7


def _sleeping_barrier(comm) -> None:
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(2e-4)


def _back_to_back(size: int) -> int:
    """Exchanges per sample: many small ones, so the two ranks' different wake-up times after the
    barrier average out; a few large ones, so a sample stays short."""
    return max(2, min(50, (4 << 20) // max(size, 1)))


def _exchange_times(transport, peer: int, sizes, repeats: int, active: bool):
    """Median seconds of one two-way exchange of each size with ``peer`` (run by both sides)."""
    medians = {}
    for size in sizes:
        send, recv = np.zeros(size, np.uint8), np.empty(size, np.uint8)
        count = _back_to_back(size)
        samples = []
        for _ in range(repeats + 1):
            _sleeping_barrier(transport.comm)
            if not active:
                continue
            start = time.perf_counter()
            for _ in range(count):
                transport.exchange([(send, peer)], [(recv, peer)])
            samples.append((time.perf_counter() - start) / count)
        if active:
            medians[size] = float(np.median(samples[1:]))
    return medians


def _alpha_beta(medians) -> tuple:
    """``alpha``: the smallest exchange's time; ``beta``: the slope between the two largest (their
    fixed costs cancel). A loaded machine can make the larger exchange look no slower than the
    smaller one; bytes are never free, so then the largest exchange's time beyond ``alpha``."""
    sizes = sorted(medians)
    alpha = medians[sizes[0]]
    big, bigger = sizes[-2], sizes[-1]
    beta = (medians[bigger] - medians[big]) / (bigger - big)
    if beta <= 0:
        beta = max(0.0, (medians[bigger] - alpha) / bigger)
    return alpha, beta


def _pair_samples(transport, comm, rank: int, pair, sizes, repeats: int) -> dict:
    """``{size: median seconds}`` of ``pair``'s two-way exchanges, known on every rank."""
    mine = rank in pair
    peer = pair[1 - pair.index(rank)] if mine else -1
    medians = _exchange_times(transport, peer, sizes, repeats, mine)
    return comm.bcast(medians if rank == pair[0] else None, root=pair[0])


def _all_lanes_sample(transport, comm, rank: int, hosts, size: int, repeats: int) -> dict:
    """Every local rank of host 0 with the same local rank of host 1, at once: the host's link shared."""
    from mpi4py import MPI

    lanes = min(len(hosts[0]), len(hosts[1]))
    partners = {hosts[0][lane]: hosts[1][lane] for lane in range(lanes)}
    partners.update({b: a for a, b in partners.items()})
    send, recv = np.zeros(size, np.uint8), np.empty(size, np.uint8)
    took = []
    for _ in range(repeats + 1):
        _sleeping_barrier(comm)
        start = time.perf_counter()
        if rank in partners:
            transport.exchange([(send, partners[rank])], [(recv, partners[rank])])
        took.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return {"lanes": lanes, "bytes": size, "seconds": float(np.median(took[1:]))}


def _reduce_sample(comm, repeats: int) -> dict:
    """gamma: everyone reduces at once, 1 MiB segments from a scratch slot into a buffer too big
    for the caches (as a pipelined schedule does)."""
    from mpi4py import MPI

    segment = np.ones(1 << 18, np.float32)
    buffer = np.ones(16 * segment.size, np.float32)
    took = []
    for _ in range(repeats + 1):
        _sleeping_barrier(comm)
        start = time.perf_counter()
        for offset in range(0, buffer.size, segment.size):
            piece = buffer[offset:offset + segment.size]
            np.add(piece, segment, out=piece)
        took.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return {"bytes": buffer.nbytes, "seconds": float(np.median(took[1:]))}


def _call_samples(pg, comm, repeats: int) -> dict:
    """Each modelled algorithm's 8-byte call through the group: its fixed cost beyond the steps."""
    from mpi4py import MPI

    from commlib.algorithms.registry import algorithm_names
    from commlib.selection.formulas import FORMULAS

    tiny = np.zeros(2, np.float32)
    calls = {}
    for name in sorted(set(FORMULAS) & set(algorithm_names())):
        took = []
        for _ in range(4 * repeats + 2):  # timed as python -m commlib.bench times a row
            comm.Barrier()
            start = time.perf_counter()
            pg.allreduce(tiny, algorithm=name)
            took.append(time.perf_counter() - start)
        slowest = np.array(took[2:])
        comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        calls[name] = float(np.median(slowest))
    return calls


def measure(pg, sizes=SIZES, repeats: int = REPEATS) -> Dict[str, Any]:
    """Collective over ``pg``: the raw samples (``intra``/``inter`` where the job has those link
    classes, ``inter_all_lanes``, ``reduce``, ``calls_8B``), on every rank."""
    from commlib.transports.mpi.transport import MPITransport

    comm = pg.comm.Dup()  # our own traffic, never mixed with the group's
    transport = MPITransport(comm)
    transport.context.begin("cost model fit", 0, "", 0, 600.0)
    samples: Dict[str, Any] = {}
    try:
        hosts = pg.topology.host_ranks
        several = [ranks for ranks in hosts if len(ranks) > 1]
        if several:
            samples["intra"] = _pair_samples(transport, comm, pg.rank, several[0][:2], sizes, repeats)
        if len(hosts) > 1:
            samples["inter"] = _pair_samples(transport, comm, pg.rank, (hosts[0][0], hosts[1][0]), sizes, repeats)
            samples["inter_all_lanes"] = _all_lanes_sample(transport, comm, pg.rank, hosts, sizes[-1], repeats)
        samples["reduce"] = _reduce_sample(comm, repeats)
        samples["calls_8B"] = _call_samples(pg, comm, repeats)
    finally:
        transport.close()
        comm.Free()
    return samples


def model_from(samples: Dict[str, Any], topology, segment_bytes: int) -> dict:
    """The model's JSON from :func:`measure`'s samples on a job of ``topology``."""
    from commlib.selection.cost_model import FORMAT
    from commlib.selection.formulas import FORMULAS, Links

    intra = _alpha_beta(samples["intra"]) if "intra" in samples else None
    inter = _alpha_beta(samples["inter"]) if "inter" in samples else None
    if intra is None:  # one rank per host: shared memory is not on the path; borrow the network's
        intra = inter if inter is not None else (0.0, 0.0)
    if inter is None:  # one host: the network is not on the path either
        inter = intra
    all_lanes = samples.get("inter_all_lanes")
    host_beta = max(0.0, (all_lanes["seconds"] - inter[0]) / (all_lanes["lanes"] * all_lanes["bytes"])
                    if all_lanes else inter[1])
    calls = samples["calls_8B"]
    gamma = samples["reduce"]["seconds"] / samples["reduce"]["bytes"]
    links = Links(intra[0], intra[1], inter[0], inter[1], host_beta, gamma, calls.get("native", 0.0), segment_bytes)
    shape = (topology.host_count, max(topology.ranks_per_host))
    stepped = {name: FORMULAS[name](links, 8.0, *shape).total for name in calls}
    return {
        "format": FORMAT,
        "links": {"intra": {"alpha": intra[0], "beta": intra[1]},
                  "inter": {"alpha": inter[0], "beta": inter[1], "host_beta": host_beta}},
        "gamma": gamma,
        "native_alpha": calls.get("native", 0.0),
        "call_overhead": {name: max(0.0, calls[name] - stepped[name]) for name in calls if name != "native"},
        "segment_bytes": segment_bytes,
        "fitted_on": {"hosts": topology.host_count, "ranks_per_host": list(topology.ranks_per_host),
                      "host_names": list(topology.host_names),
                      "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
        "samples": {key: ({str(k): v for k, v in value.items()} if key in ("intra", "inter") else value)
                    for key, value in samples.items()},
    }


def fit(pg, sizes=SIZES, repeats: int = REPEATS) -> dict:
    """Collective over ``pg``: the model's JSON (on every rank)."""
    return model_from(measure(pg, sizes, repeats), pg.topology, pg.segment_bytes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.costmodel fit",
                                     description="measure this job's links and write a cost model (JSON)")
    parser.add_argument("--out", default="costmodel.json", help="where rank 0 writes it (default costmodel.json)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help=f"samples per point (default {REPEATS})")
    args = parser.parse_args(argv)
    import json

    import commlib

    pg = commlib.init()
    if pg.size < 2:
        print("commlib.costmodel fit: run it under mpiexec with at least 2 ranks (on 2 hosts for the "
              "inter-host class)", file=sys.stderr)
        return 2
    model = fit(pg, repeats=max(2, args.repeats))
    if pg.rank == 0:
        with open(args.out, "w") as handle:
            json.dump(model, handle, indent=1)
            handle.write("\n")
        links = model["links"]
        print(f"# cost model fitted on {pg.topology.describe()}; written to {args.out}")
        print(f"intra: alpha {links['intra']['alpha'] * 1e6:.1f} us, "
              f"beta {1 / max(links['intra']['beta'], 1e-30) / 1e9:.3f} GB/s")
        print(f"inter: alpha {links['inter']['alpha'] * 1e6:.1f} us, "
              f"beta {1 / max(links['inter']['beta'], 1e-30) / 1e9:.3f} GB/s, "
              f"per host {1 / max(links['inter']['host_beta'], 1e-30) / 1e9:.3f} GB/s")
        print(f"gamma: {1 / model['gamma'] / 1e9:.3f} GB/s reduced; "
              f"native 8 B allreduce {model['native_alpha'] * 1e6:.1f} us")
        print("call overhead (us): " + ", ".join(f"{name} {seconds * 1e6:.1f}"
                                                 for name, seconds in sorted(model["call_overhead"].items())))
    return 0
