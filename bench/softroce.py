"""The RDMA ladder at the wire, in one soft-RoCE guest, between the same two rxe devices.

    python bench/softroce.py [--json out/softroce.json] [--repeats 1] [--points 32768x4096] [--iters 5]
    python bench/softroce.py --merge run1.json run2.json --json out/softroce.json   # medians of runs

As root; boots the guest (tools/softroce). Per point, reader on rxe0 and holder on rxe1 for every
rung: (1) perftest ``ib_read_bw``, (2) ``ucx_perftest -t get`` (UCT rc_verbs zcopy: the guest's
UCX cannot wire UCP up over rxe), (3) raw NIXL with pdxfer's descriptor shape and (4) pdxfer's NIXL
transport, (3) and (4) interleaved read by read (``pdxfer.probe.nixl_baseline --compare``), with
(1) and (2) right before and right after them (each rung = mean of its two runs). Also
interleaved: pdxfer polling back to back (``wait_backoff_s=0``) instead of its sleeping wait. QEMU TCG makes
absolute numbers slow and noisy: the ratios within one run are what count. Rows give GB/s per
rung, the ratio to the rung above and to ib_read_bw, the load averages and the date.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import statistics
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


def ucx_perftest(size: int, count: int, port: int, env: dict[str, str], outstanding: int = 128,
                 timeout: float = 180.0) -> float:
    """GB/s (overall) of ``ucx_perftest -t get -x rc_verbs -D zcopy`` from rxe0 reading rxe1's memory.

    UCT, not UCP: the guest's UCX (Debian 1.13) cannot wire a UCP endpoint up over rxe (UD
    wire-up times out; rc_verbs alone has no auxiliary transport), while UCT's rc_verbs get
    connects endpoint to endpoint through perftest's own socket. It is the RDMA READ layer that
    UCP's get (and NIXL's READ) end in.
    """
    env = dict(env, UCX_IB_GID_INDEX="1")  # the IPv4 RoCE v2 GID, as ib_read_bw -x 1
    tl = ["-x", "rc_verbs", "-p", str(port)]
    srv = subprocess.Popen(["ucx_perftest", "-d", "rxe1:1", *tl], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)  # no readiness signal from the server
        cli = subprocess.run(["ucx_perftest", "192.168.77.2", "-d", "rxe0:1", *tl, "-t", "get", "-D", "zcopy",
                              "-s", str(size), "-n", str(count), "-w", "64", "-O", str(outstanding)],
                             env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait(10)
    m = re.search(r"^Final:\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", cli.stdout, re.MULTILINE)
    if cli.returncode != 0 or not m:
        raise RuntimeError(f"ucx_perftest -t get -s {size} failed (rc {cli.returncode}): "
                           f"{cli.stdout[-1500:]} {cli.stderr[-1500:]}")
    return float(m.group(6)) * (1 << 20) / 1e9  # overall MB/s (UCX's MB is 2^20 bytes) -> GB/s


def nixl_pair(block: int, batch: int, iters: int, env: dict[str, str], timeout: float = 900.0) -> dict[str, Any]:
    """Raw NIXL and pdxfer's NIXL transport on the same scattered descriptors, interleaved read by
    read (pdxfer.probe.nixl_baseline --compare); reader on rxe0, both holders on rxe1."""
    cmd = [sys.executable, "-m", "pdxfer.probe.nixl_baseline", "--compare", "--block-size", str(block),
           "--batch", str(batch), "--iters", str(iters), "--timeout", "300", "--holder-env", "UCX_NET_DEVICES=rxe1:1",
           # the waiter pdxfer had before (sleep up to 1 ms between polls), interleaved too
           "--variant", "pdxfer_spin:wait_backoff_s=0"]
    res = subprocess.run(cmd, env=dict(env, UCX_NET_DEVICES="rxe0:1"), capture_output=True, text=True,
                         timeout=timeout)
    # With UCX's ib module loaded the process segfaults in a destructor after printing its result
    # (docs/softroce.md); the JSON line, printed before exit, is what counts.
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode not in (0, -11, 139) or not lines:
        raise RuntimeError(f"nixl_baseline --compare failed (rc {res.returncode}): {res.stdout[-1500:]} "
                           f"{res.stderr[-2500:]}")
    return json.loads(lines[-1])


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def ladder_point(block: int, batch: int, iters: int, port: int, env: dict[str, str]) -> dict[str, Any]:
    """The four rungs at one point, bracketed: ib_read_bw and ucx_perftest right before and right
    after the interleaved raw-NIXL/pdxfer pair, each rung's figure the mean of its two runs."""
    load0 = _loadavg()
    ib_before = ib_read_bw(block, batch, port)
    ucx_before = ucx_perftest(block, batch, port + 1, env)
    pair = nixl_pair(block, batch, iters, env)
    ucx_after = ucx_perftest(block, batch, port + 2, env)
    ib_after = ib_read_bw(block, batch, port + 3)
    ib, ucx = (ib_before + ib_after) / 2, (ucx_before + ucx_after) / 2
    raw, pdx = pair["raw_nixl_gbps"], pair["pdxfer_gbps"]
    rungs = {"ib_read_bw": ib, "ucx_perftest_get": ucx, "raw_nixl": raw, "pdxfer": pdx}
    names = list(rungs)
    old = pair.get("pdxfer_spin_gbps")
    return {
        "block_size": block, "batch": batch, "bytes": block * batch, "nixl_iters": iters,
        "gbps": rungs,
        "ratio_to_step_above": {n: (rungs[n] / rungs[names[i - 1]] if i else 1.0) for i, n in enumerate(names)},
        "ratio_to_ib_read_bw": {n: rungs[n] / ib for n in names},
        # not a rung: pdxfer polling back to back (wait_backoff_s=0), same holder, interleaved
        "pdxfer_spin_gbps": old, "pdxfer_spin_to_raw_nixl": old / raw if old else None,
        "ib_read_bw_runs_gbps": [ib_before, ib_after],
        "ucx_perftest_runs_gbps": [ucx_before, ucx_after],
        "ucx_perftest_args": f"-t get -x rc_verbs -D zcopy -s {block} -n {batch} -w 64 -O 128 (UCT)",
        "ib_read_bw_args": f"-x 1 -s {block} -n {batch} (tx-depth default 128)",
        "nixl_pair": pair, "check": "ok" if pair.get("ok") else "FAILED",
        "guest_loadavg_before": load0, "guest_loadavg_after": _loadavg(),
    }


def inside(repeats: int, points: list[tuple[int, int]], iters: int, ucx_env: dict[str, str]) -> int:
    env = dict(os.environ, **RC_ENV, **ucx_env)
    rows = []
    port = 18515
    for rep in range(repeats):
        for block, batch in points:
            row = ladder_point(block, batch, iters, port, env)
            port += 4
            row.update(repeat=rep, ucx_env=ucx_env)
            rows.append(row)
            g, r = row["gbps"], row["ratio_to_ib_read_bw"]
            print(f"{block} x {batch}: " + ", ".join(f"{n} {g[n]:.4f} GB/s ({r[n]:.2f}x ib)" for n in g)
                  + f"; pdxfer/raw {row['ratio_to_step_above']['pdxfer']:.3f} (spin wait: "
                  f"{row['pdxfer_spin_to_raw_nixl'] or 0:.3f}), check {row['check']}", flush=True)
    print(MARK + json.dumps(rows), flush=True)
    return 0


def merge(files: list[str], out: str | None) -> int:
    """Rows of several runs (each tagged with its file) and, per point, each figure's median."""
    rows = []
    for i, f in enumerate(files, 1):
        for row in json.loads(Path(f).read_text()):
            rows.append(dict(row, run=i, run_file=Path(f).name))
    medians = []
    for pt in sorted({(r["block_size"], r["batch"]) for r in rows}):
        rs = [r for r in rows if (r["block_size"], r["batch"]) == pt]
        med = {"block_size": pt[0], "batch": pt[1], "runs": len(rs)}
        for key in ("gbps", "ratio_to_step_above", "ratio_to_ib_read_bw"):
            med[key] = {n: statistics.median(r[key][n] for r in rs) for n in rs[0][key]}
        for key in ("pdxfer_spin_gbps", "pdxfer_spin_to_raw_nixl"):
            vals = [r[key] for r in rs if r.get(key)]
            med[key] = statistics.median(vals) if vals else None
        medians.append(med)
        print(f"{pt[0]} x {pt[1]} medians of {len(rs)} runs: " + ", ".join(
            f"{n} {g:.4f} GB/s ({med['ratio_to_step_above'][n]:.3f} above, {med['ratio_to_ib_read_bw'][n]:.3f} ib)"
            for n, g in med["gbps"].items()))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"medians": medians, "rows": rows}, indent=1) + "\n")
    return 0


class _Tee(io.StringIO):
    """Keeps the guest's output and, optionally, streams it."""

    def __init__(self, live: Any = None) -> None:
        super().__init__()
        self._live = live

    def write(self, text: str) -> int:
        if self._live is not None:
            self._live.write(text)
            self._live.flush()
        return super().write(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--points", default="32768x4096",
                    help="comma-separated BLOCKxBATCH points (default: the 32 KiB x 4096 scattered read)")
    ap.add_argument("--iters", type=int, default=5, help="interleaved raw NIXL / pdxfer READs per point")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--live", action="store_true", help="stream the guest's output to stderr")
    ap.add_argument("--ucx-env", action="append", default=[], metavar="K=V",
                    help="extra UCX setting for the UCX rungs (ucx_perftest, NIXL, pdxfer), e.g. "
                         "UCX_RC_MAX_RD_ATOMIC=16; recorded in the rows")
    ap.add_argument("--merge", nargs="+", metavar="RUN.json",
                    help="no guest: combine earlier runs' rows and their per-point medians into --json")
    ap.add_argument("--timeout", type=float, default=1200.0)
    a = ap.parse_args(argv)
    points = [tuple(int(x) for x in p.split("x")) for p in a.points.split(",") if p]
    ucx_env = dict(kv.split("=", 1) for kv in a.ucx_env)
    if a.inside:
        return inside(a.repeats, points, a.iters, ucx_env)
    if a.merge:
        return merge(a.merge, a.json)
    sys.path.insert(0, str(REPO / "tools" / "softroce"))
    import testbed

    # This checkout's pdxfer, not whatever the venv's editable install points at.
    prelude = (f"export PYTHONPATH={shlex.quote(str(REPO))}\n"
               "export LD_PRELOAD=$(ldconfig -p | awk '/libibverbs.so.1 .*x86-64/{print $NF; exit}')")
    sink = _Tee(sys.stderr if a.live else None)
    host_load0 = _loadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rc = testbed.run_in_guest(f"{prelude}\nexec python bench/softroce.py --inside --repeats {a.repeats} "
                              f"--points {a.points} --iters {a.iters}"
                              + "".join(f" --ucx-env {shlex.quote(kv)}" for kv in a.ucx_env),
                              REPO, Path(sys.prefix), timeout=a.timeout, sink=sink)
    host_load1 = _loadavg()
    text = sink.getvalue()
    found = [ln for ln in text.splitlines() if ln.startswith(MARK)]
    if rc != 0 or not found:
        print(text[-5000:], file=sys.stderr)
        return rc or 1
    rows = json.loads(found[-1][len(MARK):])
    for row in rows:
        row.update(date=started, host_loadavg_before=host_load0, host_loadavg_after=host_load1)
    print(f"{'point':>14} {'rung':<22} {'GB/s':>8} {'/above':>7} {'/ib':>6}")
    for row in rows:
        for n, g in row["gbps"].items():
            print(f"{row['block_size']:>7} x {row['batch']:<4} {n:<22} {g:8.4f} {row['ratio_to_step_above'][n]:7.3f} "
                  f"{row['ratio_to_ib_read_bw'][n]:6.3f}")
        print(f"{'':>14} {'(pdxfer, spin wait)':<22} {row['pdxfer_spin_gbps'] or 0:8.4f} "
              f"{row['pdxfer_spin_to_raw_nixl'] or 0:7.3f}  (to raw_nixl)")
    print(f"host load average {host_load0} -> {host_load1}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    if any(r["check"] != "ok" for r in rows):
        print("softroce: pdxfer or raw NIXL read wrong bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
