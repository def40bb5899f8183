"""Transport bandwidth matrix with same-run baselines, via pdxfer-probe.

Runs the probe's standard matrix (block size x batch) in loopback for every transport that
works here, plus NIXL forced onto TCP (``UCX_TLS=tcp``, labelled ``nixl-ucx-tcp``), each with
``--baseline`` (raw socket for tcp, raw NIXL with the same descriptors for nixl, memcpy),
then prints the headline ratios (medians, measured side by side in one run) and writes all
rows to one JSON file.

    python bench/probe.py [--quick] [--repeats 3] [--json bench/results/probe.json] [--plot FILE.png]

Headline checks (from the transports issue):
  tcp 16 MiB x 1          >= 0.8 of raw socket send/recv of the same bytes
  tcp 4096 x 32 KiB       >= 0.8 of raw socket streaming the same total into one buffer,
                          and faster than nixl-ucx-tcp
  nixl 4096 x 32 KiB      >= 0.9 of raw NIXL with the same descriptors
``--repeats`` re-measures the headline points that many times and reports the median ratio.
Those repeats also measure CPU seconds per GB on reader and holder (``--cpu``), a cost that
hardly depends on how busy the machine is: printed as informational ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdxfer.transport import KINDS  # noqa: E402
from pdxfer.transport.nixl.env import apply_ucx_env  # noqa: E402
STANDARD_BLOCKS = "4KiB,16KiB,32KiB,64KiB,256KiB,1MiB,4MiB,16MiB"
STANDARD_BATCHES = "1,64,4096"
QUICK_BLOCKS = "32KiB,1MiB,16MiB"
QUICK_BATCHES = "1,4096"


def available(kind: str) -> bool:
    """The registry's check, in a child (it may load NIXL, which this process never needs)."""
    code = f"import sys; from pdxfer.transport import unavailable_reason as u; sys.exit(u({kind!r}) is not None)"
    r = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO, capture_output=True, timeout=120)
    return r.returncode == 0


def child_env(extra: dict | None = None) -> dict:
    """This environment plus ``extra``, the UCX rule applied and this checkout importable."""
    env = apply_ucx_env(dict(os.environ, **(extra or {})))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def probe(kind: str, blocks: str, batches: str, label: str | None = None, env_extra: dict | None = None,
          baseline: bool = True, cpu: bool = False, timeout: float = 1800) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "pdxfer.probe.cli", "--loopback", "--transport", kind,
           "--block-sizes", blocks, "--batches", batches, "--json", out]
    if baseline:
        cmd.append("--baseline")
    if cpu:
        cmd.append("--cpu")
    if label:
        cmd += ["--label", label]
    try:
        subprocess.run(cmd, env=child_env(env_extra), cwd=REPO, check=True, timeout=timeout)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def find(rows: list[dict], transport: str, block: int, batch: int) -> list[dict]:
    return [r for r in rows if r["transport"] == transport and r["block_size"] == block and r["batch"] == batch]


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def headline(rows: list[dict]) -> dict:
    """The issue's ratios, each a median over every measurement of that point in this run."""
    kib32, mib16 = 32 << 10, 16 << 20
    out: dict = {}
    tcp_big = find(rows, "tcp", mib16, 1)
    tcp_sc = find(rows, "tcp", kib32, 4096)
    nixl_sc = find(rows, "nixl", kib32, 4096)
    ucx_tcp = find(rows, "nixl-ucx-tcp", kib32, 4096)
    out["tcp_16MiB_vs_raw_socket"] = med([r.get("ratio") for r in tcp_big])
    out["tcp_4096x32KiB_vs_raw_socket"] = med([r.get("ratio") for r in tcp_sc])
    # tcp vs nixl-ucx-tcp run in separate processes: pair them by repeat (adjacent in time) and
    # take the median of the pair ratios; fall back to a ratio of medians without repeats.
    pairs = [(a["gbps"], b["gbps"]) for a in tcp_sc for b in ucx_tcp
             if "repeat" in a and a.get("repeat") == b.get("repeat")]
    if pairs:
        out["tcp_4096x32KiB_vs_nixl_ucx_tcp"] = med([a / b for a, b in pairs])
    elif tcp_sc and ucx_tcp:
        out["tcp_4096x32KiB_vs_nixl_ucx_tcp"] = med([r["gbps"] for r in tcp_sc]) / med([r["gbps"] for r in ucx_tcp])
    # Only interleaved baselines: one measured apart (fallback when the raw holder did not start)
    # saw another machine load; use those only if nothing else exists.
    inter = [r for r in nixl_sc if r.get("baseline_interleaved") is not False]
    out["nixl_4096x32KiB_vs_raw_nixl"] = med([r.get("ratio") for r in inter or nixl_sc])
    out["nixl_4096x32KiB_baselines_apart"] = len(nixl_sc) - len(inter)

    # CPU seconds per GB (reader + holder) hardly depend on machine load: informational ratios.
    def cpu(rs: list[dict], prefix: str = "") -> float | None:
        return med([r[f"{prefix}reader_cpu_s_per_gb"] + r[f"{prefix}holder_cpu_s_per_gb"]
                    for r in rs if f"{prefix}reader_cpu_s_per_gb" in r])

    for name, rs in (("tcp_16MiB", tcp_big), ("tcp_4096x32KiB", tcp_sc)):
        mine, base = cpu(rs), cpu(rs, "baseline_")
        if mine and base:
            out[f"cpu_raw_socket_over_{name}"] = base / mine  # >= 1: pdxfer needs no more CPU per byte
    if cpu(tcp_sc) and cpu(ucx_tcp):
        out["cpu_nixl_ucx_tcp_over_tcp_4096x32KiB"] = cpu(ucx_tcp) / cpu(tcp_sc)
    out["targets"] = {"tcp_16MiB_vs_raw_socket": 0.8, "tcp_4096x32KiB_vs_raw_socket": 0.8,
                      "tcp_4096x32KiB_vs_nixl_ucx_tcp": 1.0, "nixl_4096x32KiB_vs_raw_nixl": 0.9}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 3x2 matrix instead of the standard 8x3")
    ap.add_argument("--repeats", type=int, default=3, help="extra measurements of the headline points")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "probe.json"))
    ap.add_argument("--plot", help="also draw bandwidth vs block size (PNG)")
    args = ap.parse_args()
    blocks, batches = (QUICK_BLOCKS, QUICK_BATCHES) if args.quick else (STANDARD_BLOCKS, STANDARD_BATCHES)
    t0 = time.monotonic()
    kinds = [k for k in KINDS if available(k)]
    rows: list[dict] = []
    for kind in kinds:
        print(f"== {kind}: matrix {blocks} x {batches}", flush=True)
        rows += probe(kind, blocks, batches)
    if "nixl" in kinds:
        print("== nixl forced onto TCP (UCX_TLS=tcp)", flush=True)
        rows += probe("nixl", "32KiB,16MiB", "1,4096", label="nixl-ucx-tcp", env_extra={"UCX_TLS": "tcp"},
                      baseline=False)
    for i in range(args.repeats):
        print(f"== headline points, repeat {i + 1}/{args.repeats}", flush=True)
        batch: list[dict] = []
        for kind in kinds:
            batch += probe(kind, "32KiB,16MiB", "1,4096", cpu=True)
        if "nixl" in kinds:
            # Right after the tcp run of this repeat, so the pair sees about the same machine load.
            batch += probe("nixl", "32KiB", "4096", label="nixl-ucx-tcp", env_extra={"UCX_TLS": "tcp"},
                           baseline=False, cpu=True)
        for r in batch:
            r["repeat"] = i
        rows += batch
    head = headline(rows)
    print("\nHeadline ratios (medians of every same-run measurement; target in brackets):")
    for name, target in head["targets"].items():
        val = head.get(name)
        verdict = "n/a" if val is None else ("meets" if val >= target else "BELOW")
        shown = "n/a" if val is None else f"{val:.2f}"
        print(f"  {name:<34} {shown:>6}  [>= {target}]  {verdict}")
    doc = {"bench": "probe", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "cpus": os.cpu_count(), "loadavg": os.getloadavg(), "seconds": round(time.monotonic() - t0, 1),
           "headline": head, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    for name, val in head.items():
        if name.startswith("cpu_") and val is not None:
            print(f"  {name:<40} {val:.2f}  (CPU s/GB reader+holder; > 1 favours pdxfer tcp)")
    print(f"wrote {args.json} ({len(rows)} rows, {doc['seconds']}s)")
    if args.plot:
        from pdxfer.probe.report import plot

        plot([r for r in rows if r["batch"] in (1, 4096)], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
