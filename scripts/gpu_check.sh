#!/usr/bin/env bash
# bash scripts/gpu_check.sh [--dry-run] [--only NAME ...]
#
# The GPU checks of commlib on a machine with an NVIDIA GPU, torch, cupy and mpi4py, in under
# 8 minutes: environment probe, single-rank NCCL collectives vs torch, the host-staged transport
# with 2 and 4 ranks on one GPU, DDP on CUDA tensors (2 ranks), comm/compute stream overlap and
# the watchdog, the duplicate-GPU preflight error. One line per check, then "N passed, N failed".
#
# Wheels found in .whl/ (e.g. the mpich wheel when the machine has no MPI library) are installed
# first: Python packages with --target /tmp/site, and the mpich wheel also with --prefix
# /tmp/site-prefix, because --target drops a wheel's data files (mpich's bin/mpiexec stays, its
# lib/libmpi.so is lost).
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl; then
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        export PATH="/tmp/site/bin:$PATH"
    else
        echo "FAIL  wheels         pip install --target /tmp/site .whl/*.whl failed"
    fi
    if compgen -G ".whl/mpich-*.whl" >/dev/null; then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
                --prefix /tmp/site-prefix .whl/mpich-*.whl; then
            # The scheme decides where bin/ and lib/ land (Debian's python adds local/): look.
            mpi_bin=$(dirname "$(find /tmp/site-prefix -name mpiexec -type f | head -n 1)")
            mpi_lib=$(dirname "$(find /tmp/site-prefix -name 'libmpi.so.12' | head -n 1)")
            export PATH="$mpi_bin:$PATH"
            export LD_LIBRARY_PATH="$mpi_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        else
            echo "FAIL  wheels         pip install --prefix /tmp/site-prefix .whl/mpich-*.whl failed"
        fi
    fi
fi

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 470 "$PY" -u scripts/gpu_check.py "$@"
