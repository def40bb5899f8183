#!/usr/bin/env bash
# Set up (idempotent) and run pdxfer's tests.
#   scripts/test.sh            every tier (what CI runs)
#   scripts/test.sh unit       keys, layouts, plans (seconds)
#   scripts/test.sh transport  TCP + NIXL conformance in two processes, network namespaces when root
#   scripts/test.sh master     master service, wire fuzzing, etcd HA and failover (starts etcd itself)
#   scripts/test.sh vllm       real `vllm serve` prefill/decode pairs on CPU (minutes)
#   scripts/test.sh rdma       soft-RoCE QEMU guest: NIXL/UCX rc_verbs READs between two rxe devices (root)
#   scripts/test.sh chaos      holders, readers, masters, etcd under injected faults + history checker (~4 min)
# Extra arguments go to pytest, e.g. scripts/test.sh unit -k plan
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
tier=${1:-all}
[ $# -gt 0 ] && shift
case "$tier" in
  all) paths=(tests) ;;
  unit|transport|master|vllm|rdma|chaos) paths=("tests/$tier") ;;
  *) echo "unknown tier '$tier' (all|unit|transport|master|vllm|rdma|chaos)" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest "${paths[@]}" -q -rs --durations=15 -p no:cacheprovider "$@"
