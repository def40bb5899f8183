#!/usr/bin/env bash
# etcd + two pdxfer-master replicas on 127.0.0.1 (OS-chosen ports). Ctrl-C stops all three.
set -euo pipefail
PY="${PYTHON:-python3}"
WORK="$(mktemp -d -t pdxfer-ha-XXXXXX)"
ETCD_PORT="${PDXFER_ETCD_PORT:-23790}"
"$(dirname "$0")/../etcd/run-local-etcd.sh" "$ETCD_PORT" "$WORK/etcd" & ETCD_PID=$!
PIDS=("$ETCD_PID")
# Stop the replicas first (the leader revokes its lease), etcd last.
trap 'kill "${PIDS[@]:1}" 2>/dev/null; sleep 0.5; kill "$ETCD_PID" 2>/dev/null; wait' EXIT INT TERM
sleep 1
for i in 1 2; do
  "$PY" -m pdxfer.master.service --host 127.0.0.1 --port 0 --port-file "$WORK/m$i.port" \
      --etcd "127.0.0.1:$ETCD_PORT" --leader-ttl 2 & PIDS+=($!)
done
for i in 1 2; do
  for _ in $(seq 100); do [ -s "$WORK/m$i.port" ] && break; sleep 0.2; done
done
echo "replicas: $(head -1 "$WORK/m1.port") $(head -1 "$WORK/m2.port") (pids ${PIDS[*]:1})"
echo "client address: etcd://127.0.0.1:$ETCD_PORT/pdxfer/master"
wait
