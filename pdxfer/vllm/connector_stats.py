"""pdxfer's numbers in vLLM's connector-stats pipeline: periodic log line and Prometheus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from pdxfer.contracts.connector_metric_defs import (COMPUTE_COST, COMPUTE_COST_KEY, COST_KEYS, COUNTERS, COUNTER_KEYS,
                                               GAUGE_KEYS, GAUGES, LOAD_COST, LOAD_COST_KEYS, LOAD_SECONDS,
                                               LOAD_SECONDS_BUCKETS, OFFLOAD_SECONDS, OFFLOAD_SECONDS_BUCKETS,
                                               PHASE_BUCKETS, PHASE_SECONDS)
from pdxfer.contracts.phase_times import PHASES, stats_key

# Counters summed across workers and the scheduler; gauges latest-wins (only the scheduler sends
# them, and only when they changed): counts as ints, the load gate's per-token costs as floats;
# lists concatenated.
_COUNTERS = COUNTER_KEYS
_GAUGES = GAUGE_KEYS + COST_KEYS
_LISTS = ("transfer_s", "offload_s") + tuple(stats_key(p) for p in PHASES)


def _gauge(key: str, v: Any) -> int | float:
    return float(v) if key in COST_KEYS else int(v)


@dataclass
class PdxferKVConnectorStats(KVConnectorStats):
    # @dataclass again: the base's generated __init__ only calls a __post_init__ it saw itself.
    def __post_init__(self) -> None:
        data = dict(self.data or {})
        self.data = {k: int(data.get(k, 0)) for k in _COUNTERS}
        self.data.update({k: list(data.get(k, [])) for k in _LISTS})
        # A gauge is absent when it did not change: absent must not read as 0.
        self.data.update({k: _gauge(k, data[k]) for k in _GAUGES if data.get(k) is not None})

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if k in _LISTS:
                self.data.setdefault(k, []).extend(v)
            elif k in _COUNTERS:
                self.data[k] = self.data.get(k, 0) + int(v)
            elif k in _GAUGES and v is not None:
                self.data[k] = _gauge(k, v)  # ``other`` is the newer report
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _COUNTERS + _LISTS) and not any(k in self.data for k in _GAUGES)

    def reduce(self) -> dict[str, int | float]:
        d = {k: self.data.get(k, 0) for k in _COUNTERS}
        ts = sorted(self.data.get("transfer_s", []))
        med = ts[len(ts) // 2] * 1e3 if ts else 0.0
        return {
            "Loads ok": d["loads_ok"],
            "Loads failed (recomputed)": d["loads_failed"],
            "Tokens loaded": d["tokens_loaded"],
            "MiB loaded": round(d["bytes_loaded"] / 2**20, 3),
            "Median load time (ms)": round(med, 3),
            "Published chunks": d["published_chunks"],
            "Freed chunks": d["freed_chunks"],
            "Master errors": d["master_errors"],
            "Late publishes": d["late_publishes"],
            "Publishes dropped (KV writes not confirmed)": d["publishes_unfenced"],
            "Lookups that waited for a hinted publish": d["publish_hint_waits"],
            "Unkeyable requests (kept out)": d["unkeyable_requests"],
            "Background errors": d["background_errors"],
            "KV transfer refused (see the log)": d["kv_transfer_refused"],
            "Loads that waited for staging": d["staging_waits"],
            "Loads failed for lack of staging": d["staging_full"],
            "Reads that never stopped (holder disconnected)": d["reads_unstopped"],
            "Chunks re-pulled from another holder": d["repulls"],
            "Tokens loaded from host tiers": d["host_tier_tokens_loaded"],
            "Host-tier copies completed": d["offloads_completed"],
            "Host-tier copies failed": d["offloads_failed"],
            "Chunks moved to host memory": d["host_moves"],
            "Host chunks evicted": d["host_evictions"],
            "MiB loaded, full-attention groups": round(d["bytes_loaded_full"] / 2**20, 3),
            "MiB loaded, sliding-window groups": round(d["bytes_loaded_sliding"] / 2**20, 3),
            "MiB loaded, recurrent state groups": round(d["bytes_loaded_state"] / 2**20, 3),
            **({"Held blocks": self.data["held_blocks"]} if "held_blocks" in self.data else {}),
        }


class PdxferPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = labelnames  # vLLM's engine labels (LABELS in connector_metric_defs)
        self.counters: dict[str, dict[int, Any]] = {}
        for key, d in zip(_COUNTERS, COUNTERS):
            c = self._counter_cls(name=d.name, documentation=d.help, labelnames=names)
            self.counters[key] = create_metric_per_engine(c, per_engine_labelvalues)
        self.gauges: dict[str, dict[int, Any]] = {}
        for key, d in zip(GAUGE_KEYS, GAUGES):
            g = self._gauge_cls(name=d.name, documentation=d.help, labelnames=names,
                                multiprocess_mode="mostrecent")
            self.gauges[key] = create_metric_per_engine(g, per_engine_labelvalues)
        # The load gate's costs (0 until measured), one gauge per stats key: per tier a child of
        # the tier-labelled one.
        g = self._gauge_cls(name=LOAD_COST.name, documentation=LOAD_COST.help,
                            labelnames=[*names, "tier"], multiprocess_mode="mostrecent")
        for tier, key in LOAD_COST_KEYS.items():
            self.gauges[key] = {idx: g.labels(*values, tier) for idx, values in per_engine_labelvalues.items()}
        g = self._gauge_cls(name=COMPUTE_COST.name, documentation=COMPUTE_COST.help, labelnames=names,
                            multiprocess_mode="mostrecent")
        self.gauges[COMPUTE_COST_KEY] = create_metric_per_engine(g, per_engine_labelvalues)
        h = self._histogram_cls(name=LOAD_SECONDS.name, documentation=LOAD_SECONDS.help, labelnames=names,
                                buckets=list(LOAD_SECONDS_BUCKETS))
        self.load_seconds = create_metric_per_engine(h, per_engine_labelvalues)
        h = self._histogram_cls(name=OFFLOAD_SECONDS.name, documentation=OFFLOAD_SECONDS.help, labelnames=names,
                                buckets=list(OFFLOAD_SECONDS_BUCKETS))
        self.offload_seconds = create_metric_per_engine(h, per_engine_labelvalues)
        self.phase_seconds: dict[str, dict[int, Any]] = {}
        for phase in PHASES:
            d = PHASE_SECONDS[phase]
            h = self._histogram_cls(name=d.name, documentation=d.help, labelnames=names,
                                    buckets=list(PHASE_BUCKETS))
            self.phase_seconds[phase] = create_metric_per_engine(h, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            v = int(transfer_stats_data.get(key, 0) or 0)
            if v:
                per_engine[engine_idx].inc(v)
        for key, per_engine in self.gauges.items():
            v = transfer_stats_data.get(key)
            if v is not None:
                per_engine[engine_idx].set(_gauge(key, v))
        for t in transfer_stats_data.get("transfer_s", []) or []:
            self.load_seconds[engine_idx].observe(t)
        for t in transfer_stats_data.get("offload_s", []) or []:
            self.offload_seconds[engine_idx].observe(t)
        for phase, per_engine in self.phase_seconds.items():
            for t in transfer_stats_data.get(stats_key(phase), []) or []:
                per_engine[engine_idx].observe(t)
