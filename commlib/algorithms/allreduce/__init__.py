"""allreduce's schedules: ring, tree, recursive doubling, Rabenseifner, hierarchical."""
