"""The line that names the cause, per fault mode of reliability_faults_ranks.py (rank 1 is the faulty rank).

Shared by tests/test_reliability.py and scripts/fault_lines.py (the 50-run count).
"""

CAUSE_LINES = {
    "exception": r"commlib: rank 1/\d+ on \S+ failed with an uncaught exception in the main thread: "
                 r"ValueError: injected failure on rank 1; aborting the MPI job",
    # Seen on the progress board while waiting: the error comes at once, not at the timeout.
    "exit": r"PeerExitedError: rank \d: allreduce #2, .* cannot complete: rank 1 exited before joining "
            r"it .*\[never heard from rank 1 \(its process exited after #1\)\]",
    "kill": r"commlib: crash witness: rank 1 \(pid (\d+) on \S+\) ended without a clean exit",
    # Rank 1 agrees to a new group, then exits cleanly, or hangs, instead of creating it: nothing
    # mpiexec notices, so the split's deadline ends the job.
    "new_group_exit": r"new_group #4, .* timed out after 2 s waiting for MPI to create the group "
                      r"\(MPI_Comm_split\) \[never heard from rank 1 \(its process exited after #4\)\]",
    "new_group_hang": r"new_group #4, .* timed out after 2 s waiting for MPI to create the group "
                      r"\(MPI_Comm_split\)",
    "skip_uncaught": r"allreduce #2, .* timed out .*never heard from rank 1 \(last started allreduce #1\)",
    "different_uncaught": r"#2, .* timed out .*out of step: .*\(called (broadcast|allreduce) #2 instead\)",
}
