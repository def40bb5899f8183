"""Master hot path vs etcd vs a dict, measured in one run.

- master: lookup_and_lock(512 keys) then release, through a real pdxfer-master process (in-memory
  store), from N concurrent client processes (default 4);
- etcd: the same 512-key lookups as ONE etcd transaction of gets via aetcd, same N clients, against
  a real etcd started here (127.0.0.1, own data dir, --max-txn-ops 2048);
- dict: the same lookups in a plain Python dict, in-process (the floor).

Prints medians, p99, lookups/s and the master/etcd ratio; ``--json FILE`` writes one object.

    python bench/master.py [--clients 4] [--iters 300] [--keys 512] [--json out.json]
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
    barrier.wait()
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
        barrier.wait()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--iters", type=int, default=300, help="lookups per client per phase")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from pdxfer.master import MasterClient, NodeInfo, start_local_master
    from pdxfer.master.local_etcd import LocalEtcd

    ctx = mp.get_context("spawn")  # grpc (aetcd) must not be forked
    work = tempfile.mkdtemp(prefix="pdxfer-bench-master-")
    master = start_local_master(workdir=work)
    etcd = LocalEtcd(work)
    try:
        etcd.start()
        c = MasterClient(master.address, timeout_s=10)
        # A realistic node description: 32 layers, separate K and V regions (~12 KB of JSON).
        layout = {
            "v": 1, "kv_format": "bench", "dtype": "bfloat16", "num_blocks": 8192, "block_size": 128,
            "kv_heads": 8, "head_dim": 128,
            "regions": [{"index": i, "nbytes": 1 << 30, "device": "cuda:0"} for i in range(64)],
            "segments": [{"layer": f"model.layers.{i}.self_attn.attn", "part": p, "region": 2 * i + (p == "v"),
                          "base": 0, "block_stride": 262144, "block_bytes": 262144}
                         for i in range(32) for p in ("k", "v")],
        }
        c.register_node(NodeInfo("bench-holder", 0, "nixl", b"x" * 550, layout, "fp"), lease_ttl_s=600)
        for p in range(args.clients):
            c.publish("bench-holder", [(k, [2 * i, 2 * i + 1]) for i, k in enumerate(_keys(p, args.keys))])
        asyncio.run(etcd_load(etcd.endpoint, args.clients, args.keys))

        res: dict[str, object] = {"keys": args.keys, "clients": args.clients, "iters_per_client": args.iters}
        one_m = run_phase(ctx, master_worker, master.address, 1, args.keys, args.iters, args.warmup)
        one_e = run_phase(ctx, etcd_worker, etcd.endpoint, 1, args.keys, max(50, args.iters // 3), args.warmup // 2)
        st0 = c.stats()
        many_m = run_phase(ctx, master_worker, master.address, args.clients, args.keys, args.iters, args.warmup)
        st1 = c.stats()
        many_e = run_phase(ctx, etcd_worker, etcd.endpoint, args.clients, args.keys, max(50, args.iters // 3),
                           args.warmup // 2)
        dict_ms = dict_floor(args.clients, args.keys, 2000)
        st = c.stats()
        # Server-side time per lookup (inside the handler): what the master itself costs, apart
        # from queueing behind other clients and CPU contention on a shared machine.
        handler_ms = (st1["lookup_handler_s"] - st0["lookup_handler_s"]) / max(1, st1["lookups"] - st0["lookups"]) * 1e3
        c.close()
        res.update({
            "master_p50_ms": round(many_m["p50_ms"], 4),
            "master_p99_ms": round(many_m["p99_ms"], 4),
            "master_release_p50_ms": round(many_m["release_p50_ms"], 4),
            "lookups_per_s": round(many_m["lookups_per_s"], 1),
            "etcd_p50_ms": round(many_e["p50_ms"], 4),
            "etcd_p99_ms": round(many_e["p99_ms"], 4),
            "etcd_lookups_per_s": round(many_e["lookups_per_s"], 1),
            "dict_p50_ms": round(dict_ms, 4),
            "master_handler_ms_per_lookup": round(handler_ms, 4),
            "ratio_master_over_etcd_p50": round(many_m["p50_ms"] / many_e["p50_ms"], 4),
            "single_client": {
                "master_p50_ms": round(one_m["p50_ms"], 4),
                "master_p99_ms": round(one_m["p99_ms"], 4),
                "master_release_p50_ms": round(one_m["release_p50_ms"], 4),
                "lookups_per_s": round(one_m["lookups_per_s"], 1),
                "etcd_p50_ms": round(one_e["p50_ms"], 4),
                "etcd_p99_ms": round(one_e["p99_ms"], 4),
                "ratio_master_over_etcd_p50": round(one_m["p50_ms"] / one_e["p50_ms"], 4),
            },
            "master_stats": {k: st[k] for k in ("lookups", "hit_chunks", "releases_ok", "releases_expired", "locks")},
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
        })
    finally:
        master.kill()
        etcd.kill()

    print(f"lookup_and_lock of {args.keys} keys, {args.clients} concurrent clients (medians; p99):")
    print(f"  master   p50 {res['master_p50_ms']:.3f} ms  p99 {res['master_p99_ms']:.3f} ms  "
          f"release p50 {res['master_release_p50_ms']:.3f} ms  {res['lookups_per_s']:.0f} lookups/s")
    print(f"  etcd txn p50 {res['etcd_p50_ms']:.3f} ms  p99 {res['etcd_p99_ms']:.3f} ms  "
          f"{res['etcd_lookups_per_s']:.0f} lookups/s")
    print(f"  dict     p50 {res['dict_p50_ms']:.3f} ms (in-process floor)")
    print(f"  master handler time per lookup {res['master_handler_ms_per_lookup']:.3f} ms (server side only)")
    print(f"  master/etcd p50 ratio {res['ratio_master_over_etcd_p50']:.3f} (target <= 0.2)")
    s1 = res["single_client"]
    print(f"  one client: master p50 {s1['master_p50_ms']:.3f} ms vs etcd p50 {s1['etcd_p50_ms']:.3f} ms "
          f"(ratio {s1['ratio_master_over_etcd_p50']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
