"""How a rank of the shared-memory transport waits for a peer's counter: spin, yield, sleep.

Waiting spins briefly, then yields the core (``sched_yield``: with more ranks than cores the
peer needs this very core to make the progress we wait for), then sleeps with backoff. It has
the collective's deadline (``CommTimeoutError`` naming the peer, its counter and the progress
board's laggards) and, while sleeping, checks that the peer process still exists (``PeerExitedError``
naming it, without waiting for the deadline) and that it runs the same kind of round
(``CollectiveMismatchError`` when the ranks chose different shared-memory algorithms).
"""

from __future__ import annotations

import os
import time

from commlib.errors import CollectiveMismatchError, CommTimeoutError, PeerExitedError
from commlib.platform.backoff import next_sleep
from commlib.platform.timer_slack import FineSleeper
from commlib.transports.shm.layout import ARRIVE, DONE, PROGRESS, PROGRESS_BITS, ROUND_WORDS, SLOT_SIGNAL

__all__ = ["PeerWaiter", "SPIN_POLLS", "OVERSUBSCRIBED_SPIN_POLLS", "SLEEP_AFTER_SECONDS",
           "MIDWAY_SLEEP_AFTER_SECONDS"]

SPIN_POLLS = 256            # ~10 us of polling before the first yield
# More ranks on the host than cores: a peer we wait for may need this very core, so yield at once
# (measured at P=4 on 2 cores, 8 B: 16 us with 1 poll, 22 us with 16, 19 us with 64; MPI 21 us;
# at P=3 1 and 32 polls were alike).
OVERSUBSCRIBED_SPIN_POLLS = 1
SLEEP_AFTER_SECONDS = 1e-4  # yielding this long turns into sleeping
# Waiting for a peer that is already inside the collective (its PROGRESS or DONE), not for its
# arrival: it runs the same schedule and is due within about the ranks' imbalance (0.1-0.2 ms at
# 16 MiB, P=2). A wait that fell asleep there woke late, and the woken rank's return made the
# call's time: at 16 MiB the allreduce took 1.01-1.03 ms against 0.84-0.88 ms without sleeping
# (same runs). So such a wait yields for longer before it sleeps, unless ranks share cores
# (then a sleeping waiter hands its core to the rank it waits for).
MIDWAY_SLEEP_AFTER_SECONDS = 2e-3
MAX_SLEEP_SECONDS = 2e-4
LIVENESS_EVERY_SECONDS = 0.1


class PeerWaiter:
    """The waits of one shared-memory transport (its counters, its context, its peers' pids)."""

    def __init__(self, transport):
        self.transport = transport

    def wait(self, peer: int, word: int, target: int, what: str) -> None:
        control = self.transport.controls[peer]
        for _ in range(self.transport.spin_polls):  # a for over a range polls a third faster than a countdown
            if control[word] >= target:
                return
        self.wait_yielding(peer, word, target, what)

    def wait_yielding(self, peer: int, word: int, target: int, what: str) -> None:
        control = self.transport.controls[peer]
        sched_yield, monotonic = os.sched_yield, time.monotonic
        start = last_check = monotonic()
        deadline = self.transport.current_context().deadline
        sleep_after = self.transport.midway_sleep_after if word == PROGRESS or word == DONE else SLEEP_AFTER_SECONDS
        sleep = 2e-5
        polls = 0
        sleeper = FineSleeper()
        try:
            while control[word] < target:
                sched_yield()
                polls += 1
                if polls & 31:
                    continue
                now = monotonic()
                if now >= deadline:
                    if control[word] >= target:
                        return
                    self.raise_timeout(peer, word, target, what)
                if now - start > sleep_after:
                    sleeper.sleep(sleep)
                    sleep = next_sleep(sleep, now - start, MAX_SLEEP_SECONDS)
                    if now - last_check > LIVENESS_EVERY_SECONDS:
                        last_check = now
                        gone = self.peer_gone(peer)
                        if gone and control[word] < target:
                            self.raise_lost(peer, word, target, what, gone)
                        if word in ROUND_WORDS:
                            other = SLOT_SIGNAL + 8 * (target & 1) if word == ARRIVE else ARRIVE
                            if control[other] >= target and control[word] < target:
                                self.raise_other_round(peer, word, target)
        finally:
            sleeper.restore()

    def raise_other_round(self, peer: int, word: int, target: int) -> None:
        """``peer`` began this epoch's round through the other counter: it runs another algorithm."""
        theirs, mine = ("an arrival round (shm_twoshot, shm_direct)", "a slot round (shm_oneshot)")
        if word == ARRIVE:
            theirs, mine = mine, theirs
        raise CollectiveMismatchError(
            f"{self.who()}: {self.transport.current_context().describe()}: rank "
            f"{self.transport.ranks[peer]} runs shared-memory epoch {target} as {theirs}, this rank as {mine}: the "
            f"ranks chose different algorithms. With algorithm='auto' the choice depends on whether a "
            f"rank's buffer is symmetric (pg.alloc): pass symmetric buffers on every rank or on none, or "
            f"name the algorithm")

    def who(self) -> str:
        """``rank R on HOST``: this rank, as error messages start."""
        transport = self.transport
        return f"rank {transport.ranks[transport.rank]} on {transport.hostname}"

    def peer_gone(self, peer: int) -> str:
        """Why ``peer``'s process can no longer make progress, or "" if it may still."""
        pid = self.transport.pids[peer]
        if pid == os.getpid():
            return ""
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "its process no longer exists"
        except PermissionError:
            pass
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return "its process has exited"
        except (OSError, IndexError):
            pass
        return ""

    def waiting_for(self, peer: int, word: int, target: int, what: str) -> str:
        value = self.transport.controls[peer][word]
        if word == PROGRESS:
            value_text = f"epoch {value >> PROGRESS_BITS} chunk {value & ((1 << PROGRESS_BITS) - 1)}"
            target_text = f"epoch {target >> PROGRESS_BITS} chunk {target & ((1 << PROGRESS_BITS) - 1)}"
        else:
            value_text, target_text = f"epoch {value}", f"epoch {target}"
        return (f"{self.transport.describe_peer(peer)} to {what} (its counter is at {value_text}, waiting for "
                f"{target_text})")

    def laggards(self) -> str:
        board = self.transport.progress_board
        if board is None:
            return ""
        return f" [{board.laggards(self.transport.context.seq, self.transport.context.collective)}]"

    def raise_timeout(self, peer: int, word: int, target: int, what: str) -> None:
        ctx = self.transport.current_context()
        # A peer in this very collective that never arrived in shared memory may run it over MPI.
        hint = (" (a peer inside this collective may run it on another path: with algorithm='auto' "
                "a symmetric buffer (pg.alloc) on some ranks and a plain one on others choose "
                "differently)") if word in ROUND_WORDS else ""
        raise CommTimeoutError(
            f"{self.who()}: {ctx.describe()} timed out after "
            f"{ctx.timeout:g} s in shared memory waiting for {self.waiting_for(peer, word, target, what)}"
            f"{self.laggards()}{hint}")

    def raise_lost(self, peer: int, word: int, target: int, what: str, gone: str) -> None:
        raise PeerExitedError(
            f"{self.who()}: {self.transport.current_context().describe()}: gave up "
            f"waiting in shared memory for {self.waiting_for(peer, word, target, what)}: {gone}"
            f"{self.laggards()}")
