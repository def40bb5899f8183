#!/usr/bin/env bash
# Set up (idempotent) and run pdxfer's tests.
#   scripts/test.sh            every tier (what CI runs), as two pytest sessions side by side
#                              (PDXFER_TEST_STREAMS=1: one session)
#   scripts/test.sh unit       keys, layouts, plans (seconds)
#   scripts/test.sh transport  TCP + NIXL conformance in two processes, network namespaces when root
#   scripts/test.sh master     master service, wire fuzzing, etcd HA and failover (starts etcd itself)
#   scripts/test.sh serve      proxy, router and launcher against real sockets and a real master (no vLLM)
#   scripts/test.sh deploy     Kubernetes manifests (offline schemas), systemd units, Dockerfiles (seconds)
#   scripts/test.sh vllm       real `vllm serve` prefill/decode pairs on CPU (minutes)
#   scripts/test.sh rdma       soft-RoCE QEMU guest: NIXL/UCX rc_verbs READs between two rxe devices (root)
#   scripts/test.sh chaos      holders, readers, masters, etcd under injected faults + history checker (~2.5 min)
#   scripts/test.sh monitoring promtool on deploy/monitoring's rules, alert tests and config; a real Prometheus
#                              scraping a live master, pair and proxy, every dashboard query answered (~1 min)
#   scripts/test.sh gpu        the prepared GPU check (tests/gpu/check.py; not part of `all`): on a machine
#                              with an NVIDIA GPU, builds the CUDA kernels and checks them and VRAM KV moves
#                              (< 8 min); elsewhere prints one line and exits 0. No setup, no venv, no
#                              network: it runs ${PYTHON:-python3} (.venv/bin/python when that has CUDA
#                              torch) and takes NIXL from .gpu-wheels/ (scripts/fetch_gpu_wheels.sh).
# Extra arguments go to pytest, e.g. scripts/test.sh unit -k plan (for gpu: to tests/gpu/check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=${1:-all}
[ $# -gt 0 ] && shift

gpu_python() {
  if [ -n "${PYTHON:-}" ]; then
    echo "$PYTHON"
  elif [ -x .venv/bin/python ] && timeout 60 .venv/bin/python -c \
      'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' >/dev/null 2>&1; then
    echo .venv/bin/python
  else
    echo python3
  fi
}

gpu_tier() {
  local py probe arch log rc
  py=$(gpu_python)
  # One bounded probe: the GPU's compute capability (sm_XY), or why there is none to use.
  probe=$(timeout 120 "$py" - 2>/dev/null <<'PY'
import sys
try:
    import torch
except Exception as exc:
    print(f"no torch ({type(exc).__name__})")
    sys.exit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA GPU")
    sys.exit(1)
major, minor = torch.cuda.get_device_capability(0)
print(f"sm_{major}{minor}")
PY
  ) || {
    if ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
      echo "gpu check: FAIL: this machine has an NVIDIA device, but $py cannot use it" \
        "(${probe:-no answer}); set PYTHON to a python with CUDA torch" >&2
      exit 1
    fi
    echo "gpu check skipped: no GPU here ($py: ${probe:-did not answer})"
    exit 0
  }
  arch=${CUDA_ARCH:-$probe}
  if [ -z "${NVCC:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x .venv/bin/nvcc ]; then
    export NVCC=.venv/bin/nvcc
  fi
  # Under 8 minutes in all: the build gets at most half, the check what is left; the check keeps
  # to its own budget (--budget-s, FAIL lines for what it could not start) and `timeout` only
  # stops a hang.
  local total=${PDXFER_GPU_CHECK_S:-470} start=$SECONDS left budget rc_check=0
  log=$(mktemp -t pdxfer-gpu-build.XXXXXX)
  rc=0
  echo "building the native kernels for $arch (native/build.sh --cuda)"
  CUDA_ARCH="$arch" timeout $((total / 2)) bash native/build.sh --cuda >"$log" 2>&1 || rc=$?
  left=$((total - (SECONDS - start)))
  budget=$((left - 90))
  [ "$budget" -ge 1 ] || budget=1  # 0 would mean no budget at all
  export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  timeout -k 10 "$left" "$py" -m tests.gpu.check --build-log "$log" --build-rc "$rc" \
    --budget-s "$budget" "$@" || rc_check=$?
  rm -f "$log"
  if [ "$rc_check" = 124 ] || [ "$rc_check" = 137 ]; then
    echo "gpu check: FAIL: stopped after $total s in all (the results file holds what it printed)" >&2
  fi
  exit "$rc_check"
}

# `all` as two pytest sessions side by side: one after the other, each leaves a third of two
# cores idle (instances starting, fault bounds running out). The first holds the vLLM pairs,
# monitoring (a pair too) and chaos, the second everything else (the soft-RoCE guest is most of
# it): about 14 + 2.5 and 17 minutes of pytest's own time when they share the cores. Each session
# keeps its own budget and summary; the run fails if either does. PDXFER_TEST_STREAMS=1 (or less
# than 16 GiB of free memory: a 2x2 fleet and the soft-RoCE guest together need about 20) runs
# one session instead.
PYTEST_ARGS=(-q -rs --durations=25 -p no:cacheprovider)
PAIR_TIERS=(tests/vllm tests/monitoring tests/chaos)
OTHER_TIERS=(tests/deploy tests/gpu tests/master tests/rdma tests/serve tests/transport tests/unit)

two_streams() {
  local py=$1 logs rc_pairs=0 rc_other=0 pid t0=$SECONDS
  shift
  for d in tests/*/; do  # a new tier folder must land in one of the sessions
    d=${d%/}
    case " ${PAIR_TIERS[*]} ${OTHER_TIERS[*]} " in
      *" $d "*) ;;
      *) if compgen -G "$d/test_*.py" >/dev/null; then echo "[test.sh] $d is in neither session (scripts/test.sh)" >&2; return 2; fi ;;
    esac
  done
  logs=.pdxfer-run/test-streams
  mkdir -p "$logs"
  # Both sessions use the tiny model: built once here, not raced by two builders.
  "$py" -c 'from pdxfer.launch.tiny_model import default_tiny_model_dir as d, make_tiny_model as m; m(d())'
  echo "[test.sh] two sessions: ${PAIR_TIERS[*]} (output in $logs/pairs.log, shown at the end) and ${OTHER_TIERS[*]}"
  "$py" -m pytest "${PAIR_TIERS[@]}" "${PYTEST_ARGS[@]}" "$@" >"$logs/pairs.log" 2>&1 &
  pid=$!
  "$py" -m pytest "${OTHER_TIERS[@]}" "${PYTEST_ARGS[@]}" "$@" || rc_other=$?
  wait "$pid" || rc_pairs=$?
  echo "================ the pairs session (${PAIR_TIERS[*]}) ================"
  cat "$logs/pairs.log"
  echo "[test.sh] both sessions done in $((SECONDS - t0)) s: ${OTHER_TIERS[*]} rc $rc_other; ${PAIR_TIERS[*]} rc $rc_pairs"
  [ "$rc_other" = 0 ] && [ "$rc_pairs" = 0 ]
}

free_gib() { awk '/^MemAvailable:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 0; }

case "$tier" in
  gpu) gpu_tier "$@" ;;  # exits: no setup.sh, no pytest
  all) paths=(tests) ;;
  unit|transport|master|serve|deploy|vllm|rdma|chaos|monitoring) paths=("tests/$tier") ;;
  *) echo "unknown tier '$tier' (all|unit|transport|master|serve|deploy|vllm|rdma|chaos|monitoring|gpu)" >&2; exit 2 ;;
esac
setup_start=$SECONDS
bash scripts/setup.sh
echo "[test.sh] set-up took $((SECONDS - setup_start)) s"
export PYTHONUNBUFFERED=1
py="${PDXFER_VENV:-.venv}/bin/python"
if [ "$tier" = all ] && [ "${PDXFER_TEST_STREAMS:-2}" != 1 ] && [ "$(free_gib)" -ge 16 ]; then
  two_streams "$py" "$@"
  exit
fi
exec "$py" -m pytest "${paths[@]}" "${PYTEST_ARGS[@]}" "$@"
