"""bench/pd.py's summary: per-length and per-concurrency rows with ratios, printed and for JSON.

Ratios are of medians (the headline) and of minimums (what an uncontended core gives); every
baseline comes from the same run. The targets are issue 12's, stated against this run's numbers.
"""

from __future__ import annotations

from typing import Any

from bench.pd_util import floor_ms, low, med, ratio

Phases = dict[str, dict[str, Any]]


def _cell(phases: Phases, cfg: str, n: int) -> dict[str, Any]:
    return phases.get(cfg, {}).get("per_len", {}).get(str(n), {})


# The plain baseline is measured before and after the pairs (--bracket): its samples pool, so a
# machine whose speed drifts over the run shifts the baseline with the pairs, not the ratios.
PLAIN_AFTER = "plain_after"


def _samples(phases: Phases, cfg: str, n: int, key: str) -> list[float]:
    xs = _cell(phases, cfg, n).get("samples", {}).get(key, [])
    if cfg == "plain":
        xs = xs + _cell(phases, PLAIN_AFTER, n).get("samples", {}).get(key, [])
    return xs


def _floor_samples(phases: Phases, cfgs: tuple[str, ...], n: int, key: str) -> list[float]:
    out: list[float] = []
    for cfg in cfgs:
        out += (phases.get(cfg, {}).get("floor", {}).get(str(n)) or {}).get(key, [])
    return out


def floor_fields(phases: Phases, cfgs: tuple[str, ...], n: int, prefix: str) -> dict[str, Any]:
    """The decode's floor at length n from the plain instances of `cfgs` (samples pooled): median
    decode step at n, a one-token prompt's latency and its own step, the HTTP cost (the one minus
    the other) and floor = step at n + HTTP cost."""
    step_n = med(_floor_samples(phases, cfgs, n, "step_ms"))
    one = med(_floor_samples(phases, cfgs, 1, "max_tokens_1_ms"))
    step_1 = med(_floor_samples(phases, cfgs, 1, "step_ms"))
    return {f"{prefix}decode_step_ms": step_n,
            f"{prefix}one_token_ttft_ms": one,
            f"{prefix}one_token_step_ms": step_1,
            f"{prefix}http_ms": round(one - step_1, 2) if one is not None and step_1 is not None else None,
            f"{prefix}floor_ms": floor_ms(step_n, one, step_1),
            f"{prefix}floor_n": len(_floor_samples(phases, cfgs, n, "step_ms"))}


def interleaved_fields(phases: Phases, n: int) -> dict[str, Any]:
    """Prefill vs plain from the interleaved configuration (same core, alternating requests), its
    decode, the decode / floor with the floor measured beside it, and how much CPU the idle
    instance of the shared core burnt during the other's request."""
    c = _cell(phases, "interleaved", n)
    s = c.get("samples", {})
    r: dict[str, Any] = {}
    for key, out in (("plain", "plain"), ("prefill", "prefill"), ("ttft", "decode")):
        xs = s.get(key, [])
        r[f"interleaved_{out}_ms"], r[f"interleaved_{out}_min_ms"] = med(xs), low(xs)
        r[f"interleaved_{out}_n"] = len(xs)
    r["interleaved_prefill_vs_plain"] = ratio(r["interleaved_prefill_ms"], r["interleaved_plain_ms"])
    r["interleaved_prefill_vs_plain_of_minimums"] = ratio(r["interleaved_prefill_min_ms"],
                                                          r["interleaved_plain_min_ms"])
    r["interleaved_loaded_tokens"] = c.get("tokens_loaded_per_request")
    r["interleaved_foreign_cpu_pct"] = (c.get("cpu") or {}).get("foreign_pct")
    partner = c.get("idle_partner_cpu_ms") or {}
    r["interleaved_idle_cpu_ms_during_plain"] = med(partner.get("plain", []))
    r["interleaved_idle_cpu_ms_during_pair"] = med(partner.get("pdxfer", []))
    r.update(floor_fields(phases, ("interleaved",), n, "interleaved_"))
    r["interleaved_decode_vs_floor"] = ratio(r["interleaved_decode_ms"], r["interleaved_floor_ms"])
    return r


def length_rows(phases: Phases, lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in lengths:
        r: dict[str, Any] = {"prompt_tokens": n}
        for cfg, key, out in (("plain", "ttft", "plain_ttft"),
                              ("pdxfer", "prefill", "pdxfer_prefill"),
                              ("pdxfer", "ttft", "pdxfer_decode"),
                              ("nixl", "prefill", "nixl_prefill"),
                              ("nixl", "ttft", "nixl_decode")):
            xs = _samples(phases, cfg, n, key)
            r[out + "_ms"], r[out + "_min_ms"], r[out + "_n"] = med(xs), low(xs), len(xs)
        for cfg in ("pdxfer", "nixl"):
            c = _cell(phases, cfg, n)
            load = c.get("load") or {}
            r[f"{cfg}_transfer_mean_ms"] = load.get("mean_ms")
            r[f"{cfg}_transfer_p50_le_ms"] = load.get("p50_le_ms")
            r[f"{cfg}_loaded_tokens"] = c.get("tokens_loaded_per_request")
            r[f"{cfg}_loaded_bytes"] = c.get("bytes_loaded_per_request")
            r[f"{cfg}_foreign_cpu_pct"] = (c.get("cpu") or {}).get("foreign_pct")
        phases_ms = _cell(phases, "pdxfer", n).get("phases_ms")
        if phases_ms:
            # The rest of the decode's TTFT: vLLM's scheduling step after the load, the one-token
            # compute, HTTP (and, counted in the median, whatever these means do not capture).
            r["pdxfer_decode_phases_ms"] = dict(phases_ms)
            if r["pdxfer_decode_ms"] is not None:
                r["pdxfer_decode_phases_ms"]["rest"] = round(r["pdxfer_decode_ms"] - sum(phases_ms.values()), 3)
        # The two halves of the pooled baseline, to see the drift they cancel.
        for key, cfg in (("plain_first_ms", "plain"), ("plain_after_ms", PLAIN_AFTER)):
            r[key] = med(_cell(phases, cfg, n).get("samples", {}).get("ttft", []))
        r["plain_foreign_cpu_pct"] = (_cell(phases, "plain", n).get("cpu") or {}).get("foreign_pct")
        for a, b, out in (("pdxfer_decode", "nixl_decode", "pdxfer_vs_nixl_decode"),
                          ("pdxfer_prefill", "plain_ttft", "pdxfer_prefill_vs_plain"),
                          ("pdxfer_decode", "plain_ttft", "pdxfer_decode_vs_plain"),
                          ("nixl_prefill", "plain_ttft", "nixl_prefill_vs_plain"),
                          ("nixl_decode", "plain_ttft", "nixl_decode_vs_plain")):
            r[out] = ratio(r[a + "_ms"], r[b + "_ms"])
            r[out + "_of_minimums"] = ratio(r[a + "_min_ms"], r[b + "_min_ms"])
        r.update(floor_fields(phases, ("plain", PLAIN_AFTER), n, ""))
        r["pdxfer_vs_nixl_bytes"] = ratio(r["pdxfer_loaded_bytes"], r["nixl_loaded_bytes"])
        r["pdxfer_decode_vs_floor"] = ratio(r["pdxfer_decode_ms"], r["floor_ms"])
        r["nixl_decode_vs_floor"] = ratio(r["nixl_decode_ms"], r["floor_ms"])
        r.update(interleaved_fields(phases, n))
        # The decode must load every prompt token but the last (vLLM computes that one).
        r["pdxfer_loads_all_but_last"] = (r["pdxfer_loaded_tokens"] == n - 1
                                          if r["pdxfer_loaded_tokens"] is not None else None)
        rows.append(r)
    return rows


def concurrency_rows(phases: Phases, levels: list[int]) -> list[dict[str, Any]]:
    rows = []
    for c in levels:
        r: dict[str, Any] = {"concurrency": c}
        for cfg in ("pdxfer", "nixl"):
            cell = phases.get(cfg, {}).get("concurrency", {}).get(str(c))
            if not cell:
                continue
            s = cell["samples"]
            load = cell.get("load") or {}
            r.update({f"{cfg}_decode_ms": med(s.get("ttft", [])),
                      f"{cfg}_decode_min_ms": low(s.get("ttft", [])),
                      f"{cfg}_decode_max_ms": round(max(s["ttft"]), 2) if s.get("ttft") else None,
                      f"{cfg}_prefill_ms": med(s.get("prefill", [])),
                      f"{cfg}_requests": len(s.get("ttft", [])),
                      f"{cfg}_transfer_mean_ms": load.get("mean_ms"),
                      f"{cfg}_transfer_p50_le_ms": load.get("p50_le_ms"),
                      f"{cfg}_transfer_p90_le_ms": load.get("p90_le_ms"),
                      f"{cfg}_transfers": load.get("count"),
                      f"{cfg}_loaded_tokens": cell.get("tokens_loaded_per_request")})
        r["pdxfer_vs_nixl_decode"] = ratio(r.get("pdxfer_decode_ms"), r.get("nixl_decode_ms"))
        rows.append(r)
    return rows


def idle_summary(phases: Phases) -> dict[str, float]:
    out: dict[str, float] = {}
    for ph in phases.values():
        for comp, pct in (ph.get("idle") or {}).get("pct_of_core", {}).items():
            out[comp] = pct
    return out


def targets(rows: list[dict[str, Any]], idle: dict[str, float]) -> dict[str, Any]:
    def every(key: str, ok: Any) -> bool | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return all(ok(v) for v in vals) if vals and len(vals) == len(rows) else None

    pdx_idle = [v for k, v in idle.items() if k.startswith("pdxfer-") and k != "master"]
    return {
        "pdxfer_decode_le_nixl_every_length": every("pdxfer_vs_nixl_decode", lambda v: v <= 1.0),
        "pdxfer_prefill_within_1.1_of_plain_every_length":
            every("pdxfer_prefill_vs_plain", lambda v: v <= 1.1),
        "pdxfer_loads_all_but_last_every_length": every("pdxfer_loads_all_but_last", bool),
        "interleaved_prefill_within_1.03_of_plain_every_length":
            every("interleaved_prefill_vs_plain", lambda v: v <= 1.03),
        "pdxfer_idle_under_5pct": all(v < 5 for v in pdx_idle) if pdx_idle else None,
    }


def _f(v: Any, w: int) -> str:
    if v is None:
        return f"{'-':>{w}}"
    return f"{v:>{w}.0f}" if isinstance(v, float) and abs(v) >= 100 else f"{v:>{w}}"


def print_summary(rows: list[dict[str, Any]], crows: list[dict[str, Any]], idle: dict[str, float],
                  tg: dict[str, Any], prompts: int) -> None:
    print(f"\nTTFT (ms, latency of a max_tokens=1 request): median / minimum over {prompts} fresh "
          f"prompts per cell")
    print(f"{'tokens':>6} | {'plain':>11} | {'pdx prefill':>11} | {'pdx decode':>11} {'loaded':>6} "
          f"{'xfer':>5} | {'nixl prefill':>12} | {'nixl decode':>11} {'loaded':>6} {'xfer':>5}")
    for r in rows:
        def mm(k: str, w: int = 11, r: dict[str, Any] = r) -> str:
            a, b = r[k + "_ms"], r[k + "_min_ms"]
            return f"{'-' if a is None else f'{a:.0f}'} / {'-' if b is None else f'{b:.0f}'}".rjust(w)
        print(f"{r['prompt_tokens']:>6} | {mm('plain_ttft')} | {mm('pdxfer_prefill')} | "
              f"{mm('pdxfer_decode')} {_f(r['pdxfer_loaded_tokens'], 6)} "
              f"{_f(r['pdxfer_transfer_mean_ms'], 5)} | {mm('nixl_prefill', 12)} | "
              f"{mm('nixl_decode')} {_f(r['nixl_loaded_tokens'], 6)} {_f(r['nixl_transfer_mean_ms'], 5)}")
    print("(xfer: mean per-request transfer time from the decode's histogram, ms; loaded: tokens "
          "per request)")
    if any(r.get("pdxfer_loaded_bytes") or r.get("nixl_loaded_bytes") for r in rows):
        print(f"\nKV bytes a decode read per request (MiB)\n{'tokens':>6} | {'pdxfer':>8} | {'nixl':>8} | pdx/nixl")
        for r in rows:
            mib = [("-" if r.get(k) is None else f"{r[k] / 2**20:.2f}").rjust(8)
                   for k in ("pdxfer_loaded_bytes", "nixl_loaded_bytes")]
            print(f"{r['prompt_tokens']:>6} | {mib[0]} | {mib[1]} | {r.get('pdxfer_vs_nixl_bytes')}")
    print(f"\nratios of medians (of minimums)\n{'tokens':>6} | {'pdx dec/nixl dec':>16} | "
          f"{'pdx pre/plain':>14} | {'pdx dec/plain':>14} | {'nixl pre/plain':>14} | "
          f"{'nixl dec/plain':>14} | foreign CPU % (plain, pdx, nixl)")
    for r in rows:
        def rr(k: str, w: int, r: dict[str, Any] = r) -> str:
            a, b = r[k], r[k + "_of_minimums"]
            return ("-" if a is None else f"{a} ({b})").rjust(w)

        foreign = ", ".join(str(r[f"{c}_foreign_cpu_pct"]) if r[f"{c}_foreign_cpu_pct"] is not None
                            else "-" for c in ("plain", "pdxfer", "nixl"))
        print(f"{r['prompt_tokens']:>6} | {rr('pdxfer_vs_nixl_decode', 16)} | "
              f"{rr('pdxfer_prefill_vs_plain', 14)} | {rr('pdxfer_decode_vs_plain', 14)} | "
              f"{rr('nixl_prefill_vs_plain', 14)} | {rr('nixl_decode_vs_plain', 14)} | {foreign}")
    phase_rows = [r for r in rows if r.get("pdxfer_decode_phases_ms")]
    if phase_rows:
        names = list(phase_rows[0]["pdxfer_decode_phases_ms"])
        print("\nwhere pdxfer's decode TTFT goes (mean ms per request; rest = median TTFT minus the "
              "phases: vLLM's step after the load, the one-token compute, HTTP)")
        print(f"{'tokens':>6} | " + " | ".join(f"{n:>12}" for n in names))
        for r in phase_rows:
            print(f"{r['prompt_tokens']:>6} | " + " | ".join(
                f"{r['pdxfer_decode_phases_ms'].get(n, 0):>12}" for n in names))
    if any(r.get("floor_ms") is not None or r.get("interleaved_floor_ms") is not None for r in rows):
        print("\nthe decode's floor (ms): one decode step at that length on a plain instance + HTTP "
              "(a one-token prompt's latency minus its own step); decode TTFT / floor")
        print(f"{'tokens':>6} | {'step':>6} {'http':>6} {'floor':>6} | {'pdx dec/floor':>13} | "
              f"{'nixl dec/floor':>14} | interleaved: {'step':>6} {'floor':>6} {'dec/floor':>9}")
        for r in rows:
            print(f"{r['prompt_tokens']:>6} | {_f(r['decode_step_ms'], 6)} {_f(r['http_ms'], 6)} "
                  f"{_f(r['floor_ms'], 6)} | {_f(r['pdxfer_decode_vs_floor'], 13)} | "
                  f"{_f(r['nixl_decode_vs_floor'], 14)} |              "
                  f"{_f(r['interleaved_decode_step_ms'], 6)} {_f(r['interleaved_floor_ms'], 6)} "
                  f"{_f(r['interleaved_decode_vs_floor'], 9)}")
    if any(r.get("interleaved_prefill_ms") is not None for r in rows):
        print("\ninterleaved (plain and pdxfer prefill on one core, requests alternating ABBA): "
              "median / minimum ms; prefill/plain of medians (of minimums); CPU ms the idle "
              "instance used during the other's request (median)")
        for r in rows:
            print(f"{r['prompt_tokens']:>6} | plain {r['interleaved_plain_ms']} / "
                  f"{r['interleaved_plain_min_ms']} | prefill {r['interleaved_prefill_ms']} / "
                  f"{r['interleaved_prefill_min_ms']} | decode {r['interleaved_decode_ms']} | "
                  f"prefill/plain {r['interleaved_prefill_vs_plain']} "
                  f"({r['interleaved_prefill_vs_plain_of_minimums']}) | idle CPU ms "
                  f"{r['interleaved_idle_cpu_ms_during_plain']} / "
                  f"{r['interleaved_idle_cpu_ms_during_pair']} | foreign CPU "
                  f"{r['interleaved_foreign_cpu_pct']}%")
    if crows:
        print("\nconcurrency (all requests at once, each prefill then decode): decode TTFT median / "
              "min / max ms; per-request transfer from the decode's histogram: mean, p50 and p90 "
              "bucket bounds (ms)")
        for r in crows:
            parts = []
            for cfg in ("pdxfer", "nixl"):
                if r.get(f"{cfg}_decode_ms") is None:
                    continue
                parts.append(f"{cfg}: {r[f'{cfg}_decode_ms']} / {r[f'{cfg}_decode_min_ms']} / "
                             f"{r[f'{cfg}_decode_max_ms']} ({r[f'{cfg}_requests']} req, prefill "
                             f"{r[f'{cfg}_prefill_ms']}), transfer {r[f'{cfg}_transfer_mean_ms']} "
                             f"(p50 <= {r[f'{cfg}_transfer_p50_le_ms']}, p90 <= "
                             f"{r[f'{cfg}_transfer_p90_le_ms']}, {r[f'{cfg}_transfers']} loads, "
                             f"{r[f'{cfg}_loaded_tokens']} tok/req)")
            print(f"  c={r['concurrency']:<3} " + "\n        ".join(parts)
                  + (f"\n        pdxfer/nixl decode {r['pdxfer_vs_nixl_decode']}"
                     if r.get("pdxfer_vs_nixl_decode") is not None else ""))
    print("\nidle CPU, % of one core (whole process group, no traffic): "
          + ", ".join(f"{k} {v}" for k, v in idle.items()))
    print("targets: " + ", ".join(f"{k} {v}" for k, v in tg.items()))
