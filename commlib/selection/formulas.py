"""Closed-form alpha-beta-gamma predictions of each allreduce algorithm's time across hosts.

Terms. ``n`` bytes; ``H`` hosts of ``K`` ranks each, placed in blocks (ranks ``hK .. hK+K-1`` on
host ``h``), ``P = H K``. Two **link classes**: ``intra`` (ranks of one host, shared memory) and
``inter`` (across hosts, a network). Per class, ``alpha`` (seconds per step: the library's
latency plus our Python per-step cost) and ``beta`` (seconds per byte of one exchange, both
directions at once); for ``inter`` also ``host_beta``: seconds per byte leaving a host when
several of its ranks send across at once (they share the host's link). ``gamma``: seconds per
byte of a local reduce, measured with every rank reducing at once.

A step in which every rank exchanges ``m`` bytes with a partner costs
``alpha_i + m beta_i`` when all partners share a host, and
``alpha_x + max(m beta_x, f m host_beta_x)`` when ``f`` of each host's ranks send across.
Steps run one after the other; a step's reduce (pipelined in segments in our schedules) is
added, not overlapped: on a loaded CPU the two compete for the same cores.

Each function returns a :class:`Breakdown` (latency, intra-host bytes, inter-host bytes, reduce,
in seconds) so that ``predict`` can say *why* one algorithm wins.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Tuple

__all__ = ["Links", "Breakdown", "FORMULAS", "predict", "hierarchical_pieces"]


@dataclasses.dataclass(frozen=True)
class Links:
    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    host_beta_inter: float
    gamma: float
    native_alpha: float  # seconds of the MPI library's own smallest allreduce at this shape's fit
    segment_bytes: int = 1 << 20
    # (algorithm, seconds): what one call costs beyond its steps (Python: planning, views, the
    # group's path), fitted from 8-byte calls; added to every prediction of that algorithm.
    call_overhead: Tuple[Tuple[str, float], ...] = ()

    def overhead(self, name: str) -> float:
        for algorithm, seconds in self.call_overhead:
            if algorithm == name:
                return seconds
        return 0.0


@dataclasses.dataclass(frozen=True)
class Breakdown:
    latency: float = 0.0
    intra: float = 0.0
    inter: float = 0.0
    reduce: float = 0.0

    @property
    def total(self) -> float:
        return self.latency + self.intra + self.inter + self.reduce

    def __add__(self, other: "Breakdown") -> "Breakdown":
        return Breakdown(self.latency + other.latency, self.intra + other.intra,
                         self.inter + other.inter, self.reduce + other.reduce)

    def scaled(self, factor: float) -> "Breakdown":
        return Breakdown(self.latency * factor, self.intra * factor, self.inter * factor, self.reduce * factor)

    def dominant(self) -> str:
        terms = {"latency (steps)": self.latency, "intra-host bytes": self.intra,
                 "inter-host bytes": self.inter, "local reduces": self.reduce}
        return max(terms, key=lambda term: terms[term])


ZERO = Breakdown()


def step(links: Links, m: float, crosses: bool, flows_per_host: int = 1) -> Breakdown:
    """One exchange of ``m`` bytes per rank; ``flows_per_host`` of each host's ranks cross."""
    if crosses:
        return Breakdown(latency=links.alpha_inter,
                         inter=max(m * links.beta_inter, flows_per_host * m * links.host_beta_inter))
    return Breakdown(latency=links.alpha_intra, intra=m * links.beta_intra)


def _fold(p: int):
    power = 1 << (p.bit_length() - 1)
    return power, p - power


def _fold_steps(links: Links, n: float, crosses: bool, flows: int = 1) -> Breakdown:
    """Folding the ``P - 2^k`` extra ranks in and out: two steps of ``n``, one reduction of ``n``."""
    return step(links, n, crosses, flows).scaled(2) + Breakdown(reduce=n * links.gamma)


def ring(links: Links, n: float, hosts: int, per_host: int) -> Breakdown:
    """``2(P-1)`` steps of ``n/P``; with several hosts each step has one crossing per host boundary."""
    p = hosts * per_host
    if p == 1:
        return ZERO
    m = n / p
    one = step(links, m, hosts > 1, 1)
    if hosts > 1:  # the host boundary is the slowest link of every step
        one = Breakdown(one.latency, 0.0, one.inter, 0.0)
    return one.scaled(2 * (p - 1)) + Breakdown(reduce=(p - 1) * m * links.gamma)


def _crosses(distance_in_ranks: int, per_host: int) -> bool:
    return distance_in_ranks >= per_host


def recursive_doubling(links: Links, n: float, hosts: int, per_host: int) -> Breakdown:
    """``log2 P'`` rounds of ``n`` (+ 2 fold steps of ``n``); round ``d`` crosses when ``d >= K``."""
    p = hosts * per_host
    if p == 1:
        return ZERO
    power, remainder = _fold(p)
    total = ZERO
    if remainder:
        total += _fold_steps(links, n, hosts > 1 and per_host == 1)
    distance = 1
    while distance < power:
        crosses = hosts > 1 and _crosses(distance, per_host)
        total += step(links, n, crosses, per_host if crosses else 1) + Breakdown(reduce=n * links.gamma)
        distance *= 2
    return total


def rabenseifner(links: Links, n: float, hosts: int, per_host: int) -> Breakdown:
    """Halving from the largest distance (``n/2`` first), then doubling back; a round crosses
    when its distance is at least ``K`` (our schedule starts at the far end: 2x2 crosses twice)."""
    p = hosts * per_host
    if p == 1:
        return ZERO
    power, remainder = _fold(p)
    total = ZERO
    if remainder:
        total += _fold_steps(links, n, hosts > 1 and per_host == 1)
    distance, m = power // 2, n / 2
    while distance >= 1:
        crosses = hosts > 1 and _crosses(distance, per_host)
        one = step(links, m, crosses, per_host if crosses else 1)
        total += one.scaled(2) + Breakdown(reduce=m * links.gamma)  # the halving and its doubling twin
        distance //= 2
        m /= 2
    return total


def tree(links: Links, n: float, hosts: int, per_host: int) -> Breakdown:
    """Pipelined binary tree, reduce then broadcast: ``depth + S - 1`` stages of a segment, an inner
    rank sending to two children; some edges cross hosts whenever there are several."""
    p = hosts * per_host
    if p == 1:
        return ZERO
    segments = max(1, math.ceil(n / links.segment_bytes))
    seg = n / segments
    depth = int(math.log2(p))
    one = step(links, 2 * seg, hosts > 1, 1)
    return one.scaled(2 * (depth + segments - 1)) + Breakdown(reduce=2 * n * links.gamma)


def hierarchical_pieces(n: float) -> int:
    from commlib.algorithms.allreduce.hierarchical import MIN_PIECE_BYTES, PIECES

    return max(1, min(PIECES, int(n // MIN_PIECE_BYTES)))


def hierarchical(links: Links, n: float, hosts: int, per_host: int) -> Breakdown:
    """Ring reduce-scatter and allgather in each host (``2(K-1)`` steps of ``n/K``), the cross
    allreduce of each ``n/K`` shard by the ``K`` ranks of a host at once (sharing its link); in
    pieces, the intra phases of all but one piece hide behind the cross phase."""
    from commlib.algorithms.allreduce.hierarchical import cross_algorithm

    if hosts * per_host == 1:
        return ZERO
    inside = step(links, n / per_host, False).scaled(2 * (per_host - 1)) + Breakdown(
        reduce=(per_host - 1) * n / per_host * links.gamma) if per_host > 1 else ZERO
    if hosts == 1:
        return inside
    pieces = hierarchical_pieces(n)
    shard = n / per_host / pieces
    cross = _among_hosts(links, cross_algorithm(hosts, int(shard)), shard, hosts, per_host).scaled(pieces)
    # Pieces overlap: the cross phase of one runs beside the intra phases of its neighbours, so
    # only the first piece's reduce-scatter and the last one's allgather add to it.
    return inside.scaled(1 / pieces) + cross


def _among_hosts(links: Links, name: str, n: float, hosts: int, flows: int) -> Breakdown:
    """One rank per host (the cross groups of hierarchical and native), ``flows`` groups at once."""
    total = ZERO
    if name == "recursive_doubling":
        power, remainder = _fold(hosts)
        rounds = int(math.log2(power)) + (2 if remainder else 0)
        return (step(links, n, True, flows) + Breakdown(reduce=n * links.gamma)).scaled(rounds)
    if name == "ring":
        m = n / hosts
        return (step(links, m, True, flows)).scaled(2 * (hosts - 1)) + Breakdown(reduce=(hosts - 1) * m * links.gamma)
    power, remainder = _fold(hosts)  # rabenseifner
    if remainder:
        total += _fold_steps(links, n, True, flows)
    m = n / 2
    for _ in range(int(math.log2(power))):
        total += step(links, m, True, flows).scaled(2) + Breakdown(reduce=m * links.gamma)
        m /= 2
    return total


def native(links: Links, n: float, hosts: int, per_host: int) -> Breakdown:
    """The MPI library's own, modelled as MPICH's composition across hosts: reduce to one rank
    per host, allreduce among those (recursive doubling up to 64 KiB, else reduce-scatter +
    allgather), broadcast in the host; on one host recursive doubling or rabenseifner. Its
    per-step cost is C's, not ours: the latency term is the measured smallest native allreduce."""
    p = hosts * per_host
    if p == 1:
        return ZERO
    fast = dataclasses.replace(links, alpha_intra=0.0, alpha_inter=0.0)
    if hosts == 1:
        body = (recursive_doubling if n <= 64 << 10 else rabenseifner)(fast, n, 1, per_host)
    else:
        levels = math.ceil(math.log2(per_host)) if per_host > 1 else 0
        inside = step(fast, n, False).scaled(2 * levels) + Breakdown(reduce=levels * n * links.gamma)
        among = _among_hosts(fast, "recursive_doubling" if n <= 64 << 10 else "rabenseifner", n, hosts, 1)
        body = inside + among
    return body + Breakdown(latency=links.native_alpha)


FORMULAS: Dict[str, Callable[[Links, float, int, int], Breakdown]] = {
    "native": native, "ring": ring, "tree": tree, "recursive_doubling": recursive_doubling,
    "rabenseifner": rabenseifner, "hierarchical": hierarchical,
}


def predict(links: Links, n: float, hosts: int, per_host: int) -> Dict[str, Breakdown]:
    single = hosts * per_host == 1
    return {name: formula(links, float(n), hosts, per_host)
            + Breakdown(latency=0.0 if single else links.overhead(name))
            for name, formula in FORMULAS.items()}
