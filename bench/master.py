"""Master hot path vs etcd vs a dict, measured in one run, at several client counts.

- master: lookup_and_lock(512 keys) then release, through a real pdxfer-master process (in-memory
  store), from N concurrent client processes;
- etcd: the same 512-key lookups as ONE etcd transaction of gets via aetcd, same N clients, against
  a real etcd started here (127.0.0.1, own data dir, --max-txn-ops 2048);
- dict: the same lookups in a plain Python dict, in-process (the floor).

For each N in ``--clients`` (default 1,4,16,64) the master and etcd phases run back to back (their
order alternates between client counts, so a drift in machine load hits both). At ``--target-clients``
(default 16) it checks the targets: master p99 <= etcd p50 / 5 and master p50 <= etcd p50 / 50.
Prints a table; writes one JSON object (``--json``, default bench/results/master.json).

    python bench/master.py [--clients 1,4,16,64] [--iters 200] [--keys 512] [--json out.json]
    python bench/master.py --clients 16 --server-cpus 0 --client-cpus 1

With ``--server-cpus``, the server being measured (the master in its phase, etcd in its own) runs
alone on those CPUs and the client processes on ``--client-cpus``: the load never takes the
measured server's core, and both servers get the same one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

PREFIX = "/bench/idx/"


def _keys(prompt: int, n: int) -> list[bytes]:
    import blake3

    return [blake3.blake3(f"bench-{prompt}-{i}".encode()).digest() for i in range(n)]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def master_worker(address: str, prompt: int, n_keys: int, iters: int, warmup: int, barrier, out) -> None:
    from pdxfer.master import MasterClient

    keys = _keys(prompt, n_keys)
    c = MasterClient(address, timeout_s=5.0)
    for _ in range(warmup):
        c.release(c.lookup_and_lock(keys, reader=f"w{prompt}").lock_id)
    lk, rl = [], []
    barrier.wait(300)
    t_start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        r = c.lookup_and_lock(keys, reader=f"w{prompt}")
        t1 = time.perf_counter()
        ok = c.release(r.lock_id)
        t2 = time.perf_counter()
        assert r.hit_chunks == n_keys and ok, (r.hit_chunks, ok)
        lk.append(t1 - t0)
        rl.append(t2 - t1)
    out.put(("master", lk, rl, t_start, time.perf_counter()))
    c.close()


def etcd_worker(endpoint: str, prompt: int, n_keys: int, iters: int, warmup: int, barrier, out) -> None:
    import aetcd

    keys = [PREFIX.encode() + k.hex().encode() for k in _keys(prompt, n_keys)]

    async def run() -> None:
        host, port = endpoint.rsplit(":", 1)
        client = aetcd.Client(host=host, port=int(port), timeout=10)
        await client.connect()
        tx = client.transactions

        async def lookup() -> int:
            ok, responses = await client.transaction(compare=[], success=[tx.get(k) for k in keys], failure=[])
            hit = 0
            for r in responses:  # contiguous prefix, like the master
                if not r:
                    break
                hit += 1
            return hit

        for _ in range(warmup):
            await lookup()
        lat = []
        barrier.wait(300)
        t_start = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            hit = await lookup()
            lat.append(time.perf_counter() - t0)
            assert hit == n_keys, hit
        out.put(("etcd", lat, [], t_start, time.perf_counter()))
        await client.close()

    asyncio.run(run())


async def etcd_load(endpoint: str, prompts: int, n_keys: int) -> None:
    import aetcd

    host, port = endpoint.rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=10) as client:
        tx = client.transactions
        for p in range(prompts):
            ks = _keys(p, n_keys)
            for start in range(0, n_keys, 128):
                ops = [tx.put(PREFIX.encode() + k.hex().encode(), json.dumps([2 * i, 2 * i + 1]).encode())
                       for i, k in enumerate(ks[start : start + 128], start)]
                await client.transaction(compare=[], success=ops, failure=[])


def run_phase(ctx, target, arg: str, clients: int, n_keys: int, iters: int, warmup: int) -> dict:
    barrier = ctx.Barrier(clients)
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(arg, p, n_keys, iters, warmup, barrier, out)) for p in range(clients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            raise RuntimeError(f"{target.__name__} client exited with {p.exitcode}")
    lat = [x for r in results for x in r[1]]
    rel = [x for r in results for x in r[2]]
    wall = max(r[4] for r in results) - min(r[3] for r in results)
    return {
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": _pct(lat, 0.99) * 1e3,
        "release_p50_ms": statistics.median(rel) * 1e3 if rel else None,
        "lookups_per_s": len(lat) / wall,
        "n": len(lat),
    }


def dict_floor(prompts: int, n_keys: int, iters: int) -> float:
    d = {k: [2 * i, 2 * i + 1] for p in range(prompts) for i, k in enumerate(_keys(p, n_keys))}
    keys = _keys(0, n_keys)
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = []
        for k in keys:
            v = d.get(k)
            if v is None:
                break
            out.append(v)
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e3


def _layout() -> dict:
    """A realistic node description: 32 layers, separate K and V regions (~12 KB of JSON)."""
    return {
        "v": 1, "kv_format": "bench", "dtype": "bfloat16", "num_blocks": 8192, "block_size": 128,
        "kv_heads": 8, "head_dim": 128,
        "regions": [{"index": i, "nbytes": 1 << 30, "device": "cuda:0"} for i in range(64)],
        "segments": [{"layer": f"model.layers.{i}.self_attn.attn", "part": p, "region": 2 * i + (p == "v"),
                      "base": 0, "block_stride": 262144, "block_bytes": 262144}
                     for i in range(32) for p in ("k", "v")],
    }


def _client_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--clients {text!r}: a comma-separated list of client counts, e.g. 1,4,16,64") from None
    if not counts or any(n < 1 for n in counts):
        raise SystemExit(f"--clients {text!r}: every count must be >= 1")
    return counts


def _cpu_list(text: str, flag: str) -> set[int]:
    try:
        cpus = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: a comma-separated list of CPU numbers, e.g. 0 or 1,2") from None
    if not cpus or not cpus <= os.sched_getaffinity(0):
        raise SystemExit(f"{flag} {text!r}: CPUs must be among this process's {sorted(os.sched_getaffinity(0))}")
    return cpus


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (etcd runs many) onto ``cpus``; threads it starts later inherit."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that just ended
            pass


def _round(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def measure(ctx, master_addr: str, etcd_endpoint: str, stats, n: int, args, etcd_first: bool) -> dict:
    """Both phases at ``n`` clients, and the master's own time per lookup (inside its handler)."""
    etcd_iters = max(10, args.etcd_iters if args.etcd_iters else args.iters // 3)

    def master_phase() -> tuple[dict, float]:
        st0 = stats()
        m = run_phase(ctx, master_worker, master_addr, n, args.keys, args.iters, args.warmup)
        st1 = stats()
        handler = (st1["lookup_handler_s"] - st0["lookup_handler_s"]) / max(1, st1["lookups"] - st0["lookups"])
        return m, handler * 1e3

    if etcd_first:
        e = run_phase(ctx, etcd_worker, etcd_endpoint, n, args.keys, etcd_iters, max(1, args.warmup // 2))
        m, handler_ms = master_phase()
    else:
        m, handler_ms = master_phase()
        e = run_phase(ctx, etcd_worker, etcd_endpoint, n, args.keys, etcd_iters, max(1, args.warmup // 2))
    return {
        "clients": n,
        "master": _round({**m, "handler_ms_per_lookup": handler_ms}),
        "etcd": _round(e),
        "ratio_master_p50_over_etcd_p50": round(m["p50_ms"] / e["p50_ms"], 5),
        "ratio_master_p99_over_etcd_p50": round(m["p99_ms"] / e["p50_ms"], 5),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,4,16,64", help="comma-separated client process counts")
    ap.add_argument("--target-clients", type=int, default=16, help="client count the targets are checked at")
    ap.add_argument("--iters", type=int, default=200, help="master lookups per client per phase")
    ap.add_argument("--etcd-iters", type=int, default=0, help="etcd lookups per client per phase (default iters/3)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "master.json"),
                    help="write the results here ('' for none)")
    ap.add_argument("--note", default="", help="recorded with the results (e.g. what else ran on the machine)")
    ap.add_argument("--server-cpus", default="",
                    help="pin the master and etcd (each in its own phase) to these CPUs, and the clients "
                         "to --client-cpus: the server measured never shares a core with the load")
    ap.add_argument("--client-cpus", default="", help="with --server-cpus: the clients' CPUs")
    args = ap.parse_args()
    counts = _client_counts(args.clients)
    server_cpus = _cpu_list(args.server_cpus, "--server-cpus") if args.server_cpus else None
    client_cpus = _cpu_list(args.client_cpus, "--client-cpus") if args.client_cpus else None
    if (server_cpus is None) != (client_cpus is None) or (server_cpus and server_cpus & client_cpus):
        raise SystemExit("--server-cpus and --client-cpus go together and must not share a CPU")

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from pdxfer.master import MasterClient, NodeInfo, start_local_master
    from pdxfer.master.backends.local_etcd import LocalEtcd

    ctx = mp.get_context("spawn")  # grpc (aetcd) must not be forked
    work = tempfile.mkdtemp(prefix="pdxfer-bench-master-")
    master = start_local_master(workdir=work)
    etcd = LocalEtcd(work)
    load_start = os.getloadavg()
    try:
        etcd.start()
        if server_cpus is not None:
            pin_process(master.proc.pid, server_cpus)
            pin_process(etcd.proc.pid, server_cpus)
            os.sched_setaffinity(0, client_cpus)  # the clients are spawned from here: they inherit it
        c = MasterClient(master.address, timeout_s=10)
        c.register_node(NodeInfo("bench-holder", 0, "nixl", b"x" * 550, _layout(), "fp"), lease_ttl_s=3600)
        prompts = max(counts)
        for p in range(prompts):
            c.publish("bench-holder", [(k, [2 * i, 2 * i + 1]) for i, k in enumerate(_keys(p, args.keys))])
        asyncio.run(etcd_load(etcd.endpoint, prompts, args.keys))
        runs = [measure(ctx, master.address, etcd.endpoint, c.stats, n, args, etcd_first=bool(j % 2))
                for j, n in enumerate(counts)]
        st = c.stats()
        c.close()
    finally:
        master.kill()
        etcd.kill()
    res: dict[str, object] = {
        "keys": args.keys, "iters_per_client": args.iters, "runs": runs,
        "dict_p50_ms": round(dict_floor(max(counts), args.keys, 2000), 4),
        "master_stats": {k: st[k] for k in ("lookups", "hit_chunks", "releases_ok", "releases_expired", "locks")},
        "cpus": os.cpu_count(), "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg(),
        "server_cpus": sorted(server_cpus) if server_cpus else "any",
        "client_cpus": sorted(client_cpus) if client_cpus else "any",
        "note": args.note,
    }
    at = next((r for r in runs if r["clients"] == args.target_clients), None)
    if at is not None:
        res["target"] = {
            "clients": args.target_clients,
            "master_p99_over_etcd_p50": at["ratio_master_p99_over_etcd_p50"], "p99_limit": 0.2,
            "master_p50_over_etcd_p50": at["ratio_master_p50_over_etcd_p50"], "p50_limit": 0.02,
            "met": at["ratio_master_p99_over_etcd_p50"] <= 0.2 and at["ratio_master_p50_over_etcd_p50"] <= 0.02,
        }

    print(f"lookup_and_lock of {args.keys} keys (+ release), per client count (ms; lookups/s):")
    print(f"{'clients':>7} | {'master p50':>10} {'p99':>8} {'lookups/s':>9} {'handler':>8} | "
          f"{'etcd p50':>9} {'p99':>8} {'lookups/s':>9} | {'p50 ratio':>9} {'p99/etcd p50':>12}")
    for r in runs:
        m, e = r["master"], r["etcd"]
        print(f"{r['clients']:>7} | {m['p50_ms']:>10.3f} {m['p99_ms']:>8.3f} {m['lookups_per_s']:>9.0f} "
              f"{m['handler_ms_per_lookup']:>8.3f} | {e['p50_ms']:>9.3f} {e['p99_ms']:>8.3f} {e['lookups_per_s']:>9.0f} | "
              f"{r['ratio_master_p50_over_etcd_p50']:>9.4f} {r['ratio_master_p99_over_etcd_p50']:>12.4f}")
    print(f"dict p50 {res['dict_p50_ms']:.3f} ms (in-process floor); handler: the master's own time per lookup")
    if at is not None:
        t = res["target"]
        print(f"at {t['clients']} clients: master p99 / etcd p50 = {t['master_p99_over_etcd_p50']:.4f} (target <= 0.2), "
              f"master p50 / etcd p50 = {t['master_p50_over_etcd_p50']:.4f} (target <= 0.02): "
              f"{'met' if t['met'] else 'NOT met'}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
