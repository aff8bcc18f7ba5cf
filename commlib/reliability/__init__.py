"""What keeps a failure from becoming a hang or a silent loss: the progress board (who started
which collective), remote progress (asked of other hosts' witnesses), the crash witness (names
the first rank to die), the abort of the whole job on an uncaught exception, and the teardown
that frees MPI objects before MPI finalizes.

Below the transports, which read the board to name laggards and notice exited peers.
"""
