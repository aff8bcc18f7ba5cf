"""What several schedules share: chunk and segment arithmetic, the pipelined exchange loop, the
binomial tree, pipelined forwarding down a tree, recursive halving, the fold onto a power of
two, and the two halves of a ring allreduce."""
