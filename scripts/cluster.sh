#!/usr/bin/env bash
# Many hosts on one machine (as root): network namespaces with their own host names, a switch,
# optional rate limits. A thin wrapper over `python -m commlib.cluster` (see commlib/cluster/cluster.py):
#   bash scripts/cluster.sh up 2 --rate 1gbit
#   bash scripts/cluster.sh run -n 4 -ppn 2 -- .venv/bin/python mpi_examples/train_digits.py
#   bash scripts/cluster.sh down
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$root/.venv/bin/python" -m commlib.cluster "$@"
