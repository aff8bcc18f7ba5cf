"""alltoall's and alltoallv's schedules: pairwise, scattered, Bruck (alltoall only)."""
