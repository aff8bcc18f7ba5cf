#!/usr/bin/env bash
# The fault-tolerance soaks: every scenario repeated with random failure steps and points, every
# check of every run (bitwise equality with a failure-free replay included); prints the counts.
#   bash scripts/ft_soak.sh                 # 10 runs of each scenario on this host
#   bash scripts/ft_soak.sh --hosts 20 x    # 20 runs of each on three namespaced hosts (as root), seed "x"
# A failing run prints its scenario and choices; the same REPETITIONS and SEED play it again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
files=(tests/ft/test_fault_tolerance.py)
if [[ "${1:-}" == "--hosts" ]]; then files=(tests/multihost/test_ft_hosts.py); shift; fi
export FT_SOAK_REPETITIONS="${1:-10}" FT_SOAK_SEED="${2:-}"
cd "$root"
log=$(mktemp)
status=0
.venv/bin/python -m pytest -m soak "${files[@]}" -s -p no:cacheprovider | tee "$log" || status=$?
echo "--- counts ---"
grep -E "^soak .*: [0-9]+/[0-9]+ runs passed every check" "$log" || true
rm -f "$log"
exit "$status"
