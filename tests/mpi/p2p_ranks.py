"""PYTHONPATH=. mpiexec -n P python tests/mpi/p2p_ranks.py

P >= 2. Point-to-point through the public ``ProcessGroup``: the checks every point-to-point channel
passes (:mod:`tests.support.p2p_checks`: send/recv/isend/irecv over dtypes and sizes, 0 included,
and tags, receives in another order than the sends, large and unexpected messages,
``ANY_SOURCE`` naming the sender, timeouts and size mismatches as errors naming rank, peer, tag
and bytes, the monitored barrier naming the ranks that did not arrive), and what only a group
with collectives can show: point-to-point never matches a collective's messages (same tag
numbers, wildcard receives posted across collectives), takes no collective sequence number, and
a blocked ``recv`` does not stall the group's comm thread.
"""

import numpy as np
from mpi4py import MPI

import commlib
from tests.support.p2p_checks import (check_any_source, check_blocked_recv_does_not_stall_the_comm_thread,
                                      check_blocking_and_nonblocking, check_errors, check_monitored_barrier,
                                      check_out_of_order_and_large, check_separate_from_collectives)
from tests.support.verdict import Checker


def main():
    pg = commlib.init(timeout=60)
    check = Checker()
    if pg.size < 2:
        check.check(False, "p2p_ranks.py needs at least 2 ranks")
        check.finish()
    sync = MPI.COMM_WORLD.Barrier  # outside commlib
    seq = pg.seq
    check_blocking_and_nonblocking(check, pg)
    check.check(pg.seq == seq, f"send/recv took {pg.seq - seq} collective numbers")
    check_out_of_order_and_large(check, pg, sync)
    check_any_source(check, pg, sync)
    check_separate_from_collectives(check, pg, sync)
    check_blocked_recv_does_not_stall_the_comm_thread(check, pg)
    check_errors(check, pg, sync)
    buf = np.ones(3)
    pg.allreduce(buf)  # the group is fine after all those errors
    check.equal(buf, np.full(3, float(pg.size)), "allreduce after point-to-point errors")
    check_monitored_barrier(check, pg, sync)
    commlib.shutdown()
    check.finish()


if __name__ == "__main__":
    main()
