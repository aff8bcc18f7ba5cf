"""The socket transport's allreduce against MPI's, with and without frame checks, and over TLS.

Run (one host; the ranks meet over MPI, then the sockets carry the collectives)::

    mpiexec -n 2 python -m commlib.bench.sockets                  # 8 B and 64 MiB
    mpiexec -n 2 python -m commlib.bench.sockets --sizes 8,1M,64M --tls --json out.json
    mpiexec -n 2 python -m autograd_bridge.bench_sockets         # the same, gloo in the table too

Contenders, in one job, taking turns call by call (:func:`commlib.bench.timing.time_interleaved`:
every call starts on a barrier, the first contender rotates, a row is the median over calls of
the slowest rank): ``MPI_Allreduce`` (mpi4py, in place), ``sockets`` (the socket transport's own
allreduce: recursive doubling, or the ring above 256 KiB), ``sockets:nochecks`` (frames carrying a
length only: what the per-frame checks cost), ``sockets:tls`` (``--tls``: a throwaway self-signed
certificate made with the ``openssl`` command), and what a caller adds (gloo, from the torch
bench). float32 sum; ``#wrong`` counts elements off the closed form in one checked call of each
contender; ``vs MPI`` and ``vs sockets`` are time ratios. The call that follows ``MPI_Allreduce``
runs slower than its place deserves on a shared machine, so the socket variants are timed once more
among themselves, and the checks' and TLS's costs are read from that pass; last, the CPU time of
one message through ``post`` and ``wait`` with and without checks, on one thread.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from commlib.bench.specs import SPECS
from commlib.bench.timing import time_interleaved
from commlib.ops import ReduceOp
from commlib.rendezvous.mpi import MPIRendezvous
from commlib.rendezvous.secret import share_secret
from commlib.transports.socket import SocketOptions, SocketTransport, TLSFiles
from commlib.units import format_bytes as format_size
from commlib.units import parse_size

__all__ = ["main", "run", "socket_contenders"]

Contenders = Dict[str, Callable[[], None]]


def _tls_files(comm) -> TLSFiles:
    """A self-signed certificate made by rank 0 and copied to every rank's own private files."""
    pem = None
    if comm.Get_rank() == 0:
        with tempfile.TemporaryDirectory() as folder:
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                            "/CN=commlib-bench", "-keyout", f"{folder}/key.pem", "-out", f"{folder}/cert.pem"],
                           check=True, capture_output=True, timeout=120)
            pem = tuple(open(f"{folder}/{name}").read() for name in ("cert.pem", "key.pem"))
    cert, key = comm.bcast(pem, root=0)
    folder = tempfile.mkdtemp(prefix="commlib-bench-tls-")
    paths = []
    for name, text in (("cert.pem", cert), ("key.pem", key)):
        path = os.path.join(folder, name)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as handle:
            handle.write(text)
        paths.append(path)
    return TLSFiles(paths[0], paths[1])


def socket_contenders(comm, buf, *, tls: bool, timeout: float = 600.0):
    """{name: run} over ``buf`` for MPI and the socket transports, and the transports (to close)."""
    rendezvous = MPIRendezvous(comm)
    secret = share_secret(rendezvous, None)
    configurations = {"sockets": SocketOptions(), "sockets:nochecks": SocketOptions(frame_checks=False)}
    if tls:
        configurations["sockets:tls"] = SocketOptions(tls=_tls_files(comm))
    transports = {name: SocketTransport(rendezvous, secret, options=options, timeout=timeout, name=f"bench-{name}")
                  for name, options in configurations.items()}
    contenders: Contenders = {"MPI_Allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)}

    def over(transport):
        def call():
            context = transport.context
            context.begin("allreduce", context.seq + 1, "native", buf.nbytes, timeout)
            transport.native_allreduce(buf, ReduceOp.SUM)
        return call

    for name, transport in transports.items():
        contenders[name] = over(transport)
    return contenders, list(transports.values())


def message_cost(nbytes: int, rounds: int = 21, per_round: int = 500) -> Dict[str, float]:
    """CPU seconds per message through the whole post/wait path (send, and receive with its
    checks; system calls included), for checked and plain frames: two engines of this process over
    a socket pair, one thread, timed by the thread's CPU clock, so the time other processes hold
    the core is not in the figure. Rounds alternate; the median round counts."""
    import socket
    import statistics

    from commlib.transports.interface import CollectiveContext
    from commlib.transports.socket.connection import Connection
    from commlib.transports.socket.framing import FrameCodec
    from commlib.transports.socket.progress import ProgressEngine

    engines = {}
    for name, checked in (("sockets", True), ("sockets:nochecks", False)):
        left, right = socket.socketpair()
        pair = []
        for rank, sock in ((0, left), (1, right)):
            codec = FrameCodec(checked, b"j" * 8, b"g" * 8, 4 << 20)
            connections: List[Optional[Connection]] = [None, None]
            connections[1 - rank] = Connection(sock, 1 - rank, "here", codec)
            context = CollectiveContext()
            context.begin("allreduce", 1, "native", nbytes, 600.0)
            pair.append(ProgressEngine(rank, connections, context))
        engines[name] = pair
    send, received = np.zeros(max(nbytes, 0), np.uint8), np.zeros(max(nbytes, 0), np.uint8)
    samples: Dict[str, List[float]] = {name: [] for name in engines}
    for round_number in range(rounds + 1):
        for name in (list(engines) if round_number % 2 else list(engines)[::-1]):
            sender, receiver = engines[name]
            start = time.thread_time()
            for _ in range(per_round):
                sender.post(((send, 1),), ())
                receiver.post((), ((received, 0),)).wait()
            if round_number:
                samples[name].append((time.thread_time() - start) / per_round)
    for sender, receiver in engines.values():
        sender.close()
        receiver.close()
    return {name: statistics.median(values) for name, values in samples.items()}


def _wrong(comm, buf, run) -> int:
    size, rank = comm.Get_size(), comm.Get_rank()
    buf[...] = rank + 1
    run()
    return comm.allreduce(int(np.count_nonzero(buf != size * (size + 1) / 2)))


def run(comm, sizes: List[int], iters: Optional[int], warmup: int, tls: bool,
        extra: Optional[Callable[[np.ndarray], Contenders]] = None) -> List[dict]:
    """The rows of the table (see the module docstring); ``extra(buf)`` adds contenders over ``buf``."""
    rows = []
    for nbytes in sizes:
        buf = np.zeros(max(nbytes // 4, 1), np.float32)
        contenders, transports = socket_contenders(comm, buf, tls=tls)
        if extra is not None:
            contenders.update(extra(buf))
        wrong = {name: _wrong(comm, buf, call) for name, call in contenders.items()}
        count = iters or (300 if buf.nbytes <= 1 << 16 else 7)
        times = time_interleaved(comm, contenders, functools.partial(buf.fill, 0), count, warmup)
        for name, seconds in times.items():
            algbw = buf.nbytes / seconds / 1e9
            rows.append(dict(size=buf.nbytes, contender=name, time_us=seconds * 1e6, algbw=algbw,
                             busbw=algbw * SPECS["allreduce"].bus_factor(comm.Get_size()), wrong=wrong[name],
                             vs_mpi=seconds / times["MPI_Allreduce"], vs_sockets=seconds / times["sockets"],
                             vs_gloo=seconds / times["gloo"] if "gloo" in times else None))
        # The call right after MPI_Allreduce runs slower (measured: whichever contender follows it,
        # by up to half at 8 B on a shared machine), so the socket variants are compared once more
        # among themselves: what the checks and TLS cost comes from this pass.
        own = {name: call for name, call in contenders.items() if name.startswith("sockets")}
        for name, seconds in time_interleaved(comm, own, functools.partial(buf.fill, 0), count, warmup).items():
            rows.append(dict(size=buf.nbytes, contender=name, time_us=seconds * 1e6, among_sockets=True))
        for transport in transports:
            transport.free_communicator()
    return rows


def print_table(rows: List[dict], ranks: int, extra_note: str = "") -> None:
    print(f"# allreduce float32 sum, {ranks} ranks on one host; median of the slowest rank{extra_note}")
    among = [row for row in rows if row.get("among_sockets")]
    rows = [row for row in rows if not row.get("among_sockets")]
    gloo = any(row["vs_gloo"] is not None for row in rows)
    print(f"{'size':>10} {'contender':>18} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
          f"{'#wrong':>7} {'vs MPI':>8} {'vs sockets':>11}" + (f" {'vs gloo':>8}" if gloo else ""))
    for row in rows:
        print(f"{format_size(row['size']):>10} {row['contender']:>18} {row['time_us']:>12.1f} {row['algbw']:>12.3f} "
              f"{row['busbw']:>12.3f} {row['wrong']:>7} {row['vs_mpi']:>8.2f} {row['vs_sockets']:>11.2f}"
              + (f" {row['vs_gloo']:>8.2f}" if gloo else ""))
    print("# the socket variants once more, among themselves (interleaved the same way):")
    for size in sorted({row["size"] for row in among}):
        of = {row["contender"]: row for row in among if row["size"] == size}
        print(f"# {format_size(size)}: " + ", ".join(f"{name} {row['time_us']:.1f} us" for name, row in of.items()))
        if "sockets:nochecks" in of:
            cost = of["sockets"]["time_us"] / of["sockets:nochecks"]["time_us"] - 1
            print(f"# {format_size(size)}: the per-frame checks cost {cost * 100:+.1f}% (sockets vs sockets:nochecks)")
        if "sockets:tls" in of:
            cost = of["sockets:tls"]["time_us"] / of["sockets"]["time_us"] - 1
            print(f"# {format_size(size)}: TLS costs {cost * 100:+.1f}% (sockets:tls vs sockets)")


def parse_args(argv=None, description: str = __doc__):
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--sizes", default="8,64M", help="comma-separated sizes in bytes (K, M suffixes)")
    parser.add_argument("-n", "--iters", type=int, default=0, help="timed calls per contender (default: by size)")
    parser.add_argument("-w", "--warmup", type=int, default=2)
    parser.add_argument("--tls", action="store_true", help="also time TLS links (needs the openssl command)")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    return parser.parse_args(argv)


def main(argv=None, extra=None, extra_note: str = "") -> None:
    """The benchmark; ``extra(comm)`` returns the ``extra`` of :func:`run` (more contenders)."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rows = run(comm, [parse_size(text) for text in args.sizes.split(",")], args.iters or None, args.warmup,
               args.tls, extra(comm) if extra is not None else None)
    # What fits a socket pair's buffer: one thread sends and then receives it.
    costs = {size: message_cost(size) for size in (8, 64 << 10)} if comm.Get_rank() == 0 else {}
    if comm.Get_rank() == 0:
        print_table(rows, comm.Get_size(), extra_note)
        print("# CPU time of one message through post and wait, one thread (two engines over a socket pair):")
        for size, cost in costs.items():
            print(f"#   {format_size(size):>7}: checked {cost['sockets'] * 1e6:8.2f} us, plain "
                  f"{cost['sockets:nochecks'] * 1e6:8.2f} us: the checks cost "
                  f"{(cost['sockets'] / cost['sockets:nochecks'] - 1) * 100:+.1f}%")
        rows.extend(dict(size=size, contender=f"message_cost:{name}", time_us=seconds * 1e6)
                    for size, cost in costs.items() for name, seconds in cost.items())
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
