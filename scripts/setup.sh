#!/usr/bin/env bash
# Set up everything in ./.venv: commlib-ddp (editable) with the MPICH wheel (mpiexec lands in
# .venv/bin), the CPU build of torch, and the test and example extras, all pinned by
# constraints.txt so every machine (and CI) gets the same versions. Safe to run again.
# With a system MPI instead of the wheel: pip install -e ".[torch,test,examples]" yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints.txt -e ".[mpi,torch,test,examples]"
# Byte-compile the project once: every rank, example and tool the tests start would otherwise
# compile what it imports anew (PYTHONDONTWRITEBYTECODE is common in CI), about 0.1 s of CPU per
# process over the suite's hundreds of processes. Stale files are recompiled on import as usual.
.venv/bin/python -m compileall -q -j 0 commlib ddp autograd_bridge tests mpi_examples scripts > /dev/null
