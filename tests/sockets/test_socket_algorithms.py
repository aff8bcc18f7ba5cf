"""Every registered algorithm of every collective over the socket transport, at 1, 2, 3 and 4 ranks.

Real processes (spawned), real sockets, meeting through our TCP store; inputs with closed-form
results (tests/sockets/cases.py), checked exactly on every rank. One world of processes per size
serves all algorithms. The shared-memory algorithms need the shared-memory transport and are
left out; the hierarchical allreduce runs with its ranks placed on two emulated hosts, so its
cross-host phases run over the sockets.
"""

import pytest

from commlib.algorithms.registry import COLLECTIVES, algorithm_names, get_algorithm
from tests.support.socket_world import SocketWorld

CASES = [(collective, name) for collective in COLLECTIVES if collective != "barrier"
         for name in algorithm_names(collective)
         if not getattr(get_algorithm(name, collective), "requires_shared_memory", False)]
BARRIERS = algorithm_names("barrier")
HOSTS = {3: [2, 1], 4: [2, 2]}  # the hierarchical allreduce's emulated hosts


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda size: f"p{size}")
def world(request):
    world = SocketWorld(request.param)
    try:
        assert all(outcome[0] == "ok" for outcome in world.started), world.started
        yield world
    finally:
        world.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective,name", CASES, ids=[f"{c}-{n}" for c, n in CASES])
def test_every_algorithm_against_closed_form(world, collective, name):
    shape = HOSTS.get(world.size) if name == "hierarchical" else None
    problems = world.run("tests.sockets.socket_ranks:run_matrix", collective, name, shape, timeout=500)
    bad = {rank: found for rank, found in enumerate(problems) if found}
    assert not bad, f"{collective} {name} p={world.size}: {bad}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", BARRIERS)
def test_every_barrier_waits_for_every_rank(world, name):
    late = world.run("tests.sockets.socket_ranks:run_barrier", name, timeout=200)
    assert not any(late), late


@pytest.mark.timeout(300)
def test_messages_larger_than_a_frame_go_in_pieces():
    from commlib.transports.socket import SocketOptions
    from tests.support.socket_world import RankSetup

    options = SocketOptions(frame_bytes=4096, segment_bytes=1 << 20)  # 2.4 MB messages: 600 frames each
    with SocketWorld(3, setup=RankSetup(options=options)) as world:
        assert all(outcome[0] == "ok" for outcome in world.started), world.started
        assert world.run("tests.sockets.socket_ranks:algorithms_over", ["native", "ring", "tree"]) == [None] * 3


@pytest.mark.timeout(300)
def test_the_groups_small_allreduce_is_exact_on_and_off_its_fast_path(world):
    """At 2 and 4 ranks the group's small allreduce runs straight on the sockets
    (commlib/transports/socket/fast_path.py); with rank 0 on the general path meanwhile the
    results are the same; at 3 ranks (folded recursive doubling) every call takes the general path."""
    outcomes = world.run("tests.sockets.socket_ranks:group_small_allreduces", timeout=250)
    assert [problems for problems, _, _ in outcomes] == [None] * world.size, outcomes
    for rank, (_, ran, due) in enumerate(outcomes):
        assert ran == due, f"rank {rank}: the fast path ran {ran} calls of {due}"
        assert (due > 0) == (world.size in (2, 4)), (rank, due)
