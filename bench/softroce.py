"""pdxfer-probe over soft-RoCE beside perftest's ib_read_bw, between the same two rxe devices.

    python bench/softroce.py [--json out/softroce.json] [--repeats 1]   # as root; boots the guest

Inside the soft-RoCE guest (tools/softroce) a probe holder serves on rxe1 and the probe reader
reads on rxe0 with NIXL/UCX rc_verbs; ``ib_read_bw`` runs between the same devices with the same
message size right before and right after each probe point (QEMU TCG makes absolute numbers slow
and noisy: the ratio is what counts). Rows carry the probe's usual columns plus ``baseline``
(``ib_read_bw``), ``baseline_gbps`` (mean of the two bracketing runs) and ``ratio``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
POINTS = ((1 << 20, 64), (32 << 10, 4096))  # (block size, batch): one big read, scattered blocks
MARK = "SOFTROCE-ROWS "
RC_ENV = {"UCX_MODULES": "all", "UCX_TLS": "rc_verbs,ud_verbs,self", "NIXL_LOG_LEVEL": "WARN"}


def ib_read_bw(size: int, iters: int, port: int, timeout: float = 120.0) -> float:
    """GB/s (average column) of ib_read_bw from rxe0 reading rxe1's memory."""
    common = ["-d", "rxe1", "-x", "1", "-s", str(size), "-n", str(iters), "-p", str(port), "--report_gbits"]
    srv = subprocess.Popen(["ib_read_bw", *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)  # the server must listen before the client connects (no readiness signal)
        cli = subprocess.run(["ib_read_bw", *common[:1], "rxe0", *common[2:], "192.168.77.2"],
                             capture_output=True, text=True, timeout=timeout)
    finally:
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait(10)
    m = re.search(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", cli.stdout, re.MULTILINE)
    if cli.returncode != 0 or not m:
        raise RuntimeError(f"ib_read_bw -s {size} failed (rc {cli.returncode}): {cli.stdout[-1500:]} {cli.stderr[-500:]}")
    return float(m.group(4)) / 8.0  # Gb/s -> GB/s


def probe_point(peer: str, block: int, batch: int, env: dict[str, str]) -> dict[str, Any]:
    out = Path("/tmp/softroce-probe.json")
    cmd = [sys.executable, "-m", "pdxfer.probe.cli", "read", "--peer", peer, "--transport", "nixl",
           "--block-sizes", str(block), "--batches", str(batch), "--target-mib", "256", "--check",
           "--quiet", "--json", str(out)]
    out.unlink(missing_ok=True)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    # With UCX's ib module loaded the process segfaults in a destructor after writing its results
    # (docs/softroce.md); the JSON, written before exit, is what counts.
    if res.returncode not in (0, -11, 139) or not out.exists():
        raise RuntimeError(f"pdxfer-probe read failed (rc {res.returncode}): {res.stdout[-1500:]} {res.stderr[-1500:]}")
    (row,) = json.loads(out.read_text())
    return row


def inside(repeats: int) -> int:
    env = dict(os.environ, **RC_ENV)
    serve = subprocess.Popen([sys.executable, "-m", "pdxfer.probe.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                              "--region-size", str(160 << 20), "--transport", "nixl"],
                             env=dict(env, UCX_NET_DEVICES="rxe1:1"), stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    rows = []
    try:
        assert serve.stdout is not None
        deadline = time.monotonic() + 180
        peer = None
        while peer is None and time.monotonic() < deadline:
            line = serve.stdout.readline()
            if not line:
                raise RuntimeError(f"probe server exited (rc {serve.poll()})")
            if line.startswith("PROBE-SERVE "):
                peer = line.split()[1]
        if peer is None:
            raise RuntimeError("probe server did not start within 180 s")
        port = 18515
        for _ in range(repeats):
            for block, batch in POINTS:
                iters = max(50, (256 << 20) // block // 4)
                before = ib_read_bw(block, iters, port)
                row = probe_point(peer, block, batch, dict(env, UCX_NET_DEVICES="rxe0:1"))
                after = ib_read_bw(block, iters, port + 1)
                port += 2
                base = (before + after) / 2
                row.update(baseline="ib_read_bw", baseline_gbps=base, baseline_runs_gbps=[before, after],
                           baseline_interleaved=True, ratio=row["gbps"] / base if base else None)
                rows.append(row)
                print(f"{block} x {batch}: probe {row['gbps']:.3f} GB/s, ib_read_bw {before:.3f}/{after:.3f} GB/s, "
                      f"ratio {row['ratio']:.2f}, check {row.get('check')}", flush=True)
    finally:
        serve.terminate()
        try:
            serve.wait(15)
        except subprocess.TimeoutExpired:
            serve.kill()
    print(MARK + json.dumps(rows), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--timeout", type=float, default=1200.0)
    a = ap.parse_args(argv)
    if a.inside:
        return inside(a.repeats)
    sys.path.insert(0, str(REPO / "tools" / "softroce"))
    import testbed

    prelude = "export LD_PRELOAD=$(ldconfig -p | awk '/libibverbs.so.1 .*x86-64/{print $NF; exit}')"
    sink = io.StringIO()
    rc = testbed.run_in_guest(f"{prelude}\nexec python bench/softroce.py --inside --repeats {a.repeats}",
                              REPO, Path(sys.prefix), timeout=a.timeout, sink=sink)
    text = sink.getvalue()
    found = [ln for ln in text.splitlines() if ln.startswith(MARK)]
    if rc != 0 or not found:
        print(text[-5000:], file=sys.stderr)
        return rc or 1
    rows = json.loads(found[-1][len(MARK):])
    from pdxfer.probe import report

    print(report.HEADER)
    for row in rows:
        print(report.line(row))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
