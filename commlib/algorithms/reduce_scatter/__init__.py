"""reduce_scatter's schedules: ring, recursive halving, pairwise."""
