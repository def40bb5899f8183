"""Probe output: nixlbench-like lines (live, one per point), a summary table and a plot."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Sequence

HEADER = (f"{'Transport':<14}{'Block Size':>11}{'Batch':>7}{'B/W (GB/s)':>12}{'Avg Lat(us)':>13}"
          f"{'Prep(us)':>10}{'P99 Prep':>10}{'Post(us)':>10}{'P99 Post':>10}{'Tx(us)':>11}{'P99 Tx':>11}"
          f"{'Baseline':>22}{'Ratio':>7}{'Check':>7}")


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def line(r: dict[str, Any]) -> str:
    base = ""
    if r.get("baseline_gbps"):
        apart = "(apart)" if r.get("baseline_interleaved") is False else ""  # not interleaved: see cli
        base = f"{r['baseline']}{apart} {r['baseline_gbps']:.3f}"
    elif r.get("baseline_error"):
        base = f"{r['baseline']} error"
    ratio = f"{r['ratio']:.2f}" if r.get("ratio") else ""
    return (f"{r['transport']:<14}{fmt_size(r['block_size']):>11}{r['batch']:>7}{r['gbps']:>12.3f}"
            f"{r['avg_lat_us']:>13.1f}{r['prep_avg_us']:>10.1f}{r['prep_p99_us']:>10.1f}"
            f"{r['post_avg_us']:>10.1f}{r['post_p99_us']:>10.1f}{r['tx_avg_us']:>11.1f}{r['tx_p99_us']:>11.1f}"
            f"{base:>22}{ratio:>7}{r.get('check', ''):>7}")


def cpu_line(r: dict[str, Any]) -> str:
    out = f"CPU s/GB: reader {r['reader_cpu_s_per_gb']:.3f} holder {r['holder_cpu_s_per_gb']:.3f}"
    if "baseline_reader_cpu_s_per_gb" in r:
        out += (f" | raw socket: reader {r['baseline_reader_cpu_s_per_gb']:.3f}"
                f" holder {r['baseline_holder_cpu_s_per_gb']:.3f}")
    return out


class LiveTable:
    """Prints each row as it is measured, with a [done/total] counter and elapsed time."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total, self.n = enabled, total, 0
        self.t0 = time.monotonic()
        if enabled:
            print(HEADER, flush=True)

    def row(self, r: dict[str, Any]) -> None:
        self.n += 1
        if self.enabled:
            print(f"{line(r)}   [{self.n}/{self.total} {time.monotonic() - self.t0:.0f}s]", flush=True)
            if "reader_cpu_s_per_gb" in r:
                print("    " + cpu_line(r), flush=True)

    def done(self, rows: Sequence[dict[str, Any]]) -> None:
        if not self.enabled:
            print(HEADER)
            for r in rows:
                print(line(r))
        extra = [r for r in rows if r.get("memcpy_gbps")]
        if extra:
            print("memcpy limit (same byte count, one contiguous copy): " +
                  ", ".join(f"{fmt_size(r['bytes'])}: {r['memcpy_gbps']:.2f} GB/s"
                            for r in {r['bytes']: r for r in extra}.values()), file=sys.stdout)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Bandwidth vs block size, one line per (transport, batch); dashed: its same-run baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["transport"], r["batch"]), []).append(r)
    for (kind, batch), rs in sorted(groups.items()):
        # Repeated points (bench repeats) are drawn as their median.
        by_block: dict[int, list[dict[str, Any]]] = {}
        for r in rs:
            by_block.setdefault(r["block_size"], []).append(r)
        xs = sorted(by_block)
        ys = [statistics.median(r["gbps"] for r in by_block[x]) for x in xs]
        (ln,) = ax.plot(xs, ys, marker="o", label=f"{kind} batch {batch}")
        bx = [x for x in xs if any(r.get("baseline_gbps") for r in by_block[x])]
        if bx:
            by = [statistics.median(r["baseline_gbps"] for r in by_block[x] if r.get("baseline_gbps")) for x in bx]
            name = next(r["baseline"] for r in rs if r.get("baseline_gbps"))
            ax.plot(bx, by, ls="--", color=ln.get_color(), alpha=0.6, label=f"{name} (batch {batch})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (bytes)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("pdxfer-probe: READ bandwidth vs block size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
