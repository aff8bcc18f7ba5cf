"""ProcessGroup.abort over the socket transport, in real processes: a collective that cannot finish
(a peer that sends nothing, as a host cut off from the network) ends on every rank within a second
of the abort, naming it, where the group's timeout is a minute; the group stays failed."""

import pytest

from tests.support.socket_world import SocketWorld

RANKS = "tests.sockets.abort_ranks"


@pytest.fixture
def world():
    with SocketWorld(3) as world:
        assert world.run(f"{RANKS}:setup") == [0, 1, 2]
        yield world


def test_an_abort_ends_the_collective_on_every_rank_at_once_and_names_why(world):
    after = 0.5
    outcomes = world.run(f"{RANKS}:allreduce_aborted_by", 0, 2, after)
    kind, message, seconds = outcomes[0]
    assert kind == "GroupAbortedError" and "aborted: the coordinator lost a member" in message, outcomes[0]
    assert "rank 0 of 3" in message and after <= seconds < after + 2.0, outcomes[0]
    kind, message, seconds = outcomes[1]  # it waited for rank 0's bytes: rank 0's ABORT reached it
    assert kind != "ok" and "the coordinator lost a member" in message and seconds < after + 2.0, outcomes[1]
    kind, message, seconds = outcomes[2]  # the late one: the ABORT was there before it posted
    assert kind != "ok" and "the coordinator lost a member" in message and seconds < 2.0, outcomes[2]
    # nothing works any more on any rank, and it says so at once
    for kind, message, seconds in world.run(f"{RANKS}:next_collective"):
        assert kind != "ok" and seconds < 2.0, (kind, message)


def test_an_abort_ends_a_pending_receive(world):
    outcome = world.run(f"{RANKS}:recv_aborted", 0.3)[0]
    assert outcome[0] == "GroupAbortedError" and "aborted: no sender" in outcome[1], outcome
    assert outcome[2] < 2.3, outcome
