"""pdxfer's numbers in vLLM's connector-stats pipeline: periodic log line and Prometheus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from pdxfer.vllm.phase_times import PHASES, stats_key

# Counters summed across workers and the scheduler; lists concatenated.
_COUNTERS = ("loads_ok", "loads_failed", "tokens_loaded", "bytes_loaded", "lookups", "lookup_hit_tokens",
             "master_errors", "published_chunks", "freed_chunks", "pressure_reclaims", "late_publishes",
             "unkeyable_requests", "background_errors", "publish_hint_waits", "publish_hint_timeouts",
             "kv_transfer_refused", "staging_waits", "staging_full", "reads_unstopped", "publishes_unfenced", "repulls")
_LISTS = ("transfer_s",) + tuple(stats_key(p) for p in PHASES)
_PHASE_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]


@dataclass
class PdxferKVConnectorStats(KVConnectorStats):
    # @dataclass again: the base's generated __init__ only calls a __post_init__ it saw itself.
    def __post_init__(self) -> None:
        data = dict(self.data or {})
        self.data = {k: int(data.get(k, 0)) for k in _COUNTERS}
        self.data.update({k: list(data.get(k, [])) for k in _LISTS})

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if k in _LISTS:
                self.data.setdefault(k, []).extend(v)
            elif k in _COUNTERS:
                self.data[k] = self.data.get(k, 0) + int(v)
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _COUNTERS + _LISTS)

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
        }


class PdxferPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        docs = {
            "loads_ok": "KV loads validated at release",
            "loads_failed": "KV loads that failed and were recomputed",
            "tokens_loaded": "Prompt tokens whose KV was read from a holder",
            "bytes_loaded": "KV bytes read from holders",
            "published_chunks": "Chunks published to the pdxfer master",
            "freed_chunks": "Held chunks returned to the block pool",
            "master_errors": "Master calls that failed on the scheduler hot path",
            "unkeyable_requests": "Requests kept out of the connector: their KV is not named by their "
                                  "tokens (LoRA, multimodal inputs, prompt embeddings)",
            "background_errors": "Unexpected errors the holder's reaper or publisher survived (see the log)",
            "publish_hint_waits": "Decode lookups that waited for chunks their prefill's hint announced",
            "publish_hint_timeouts": "... that went on without some of them (the publish came too late)",
            "kv_transfer_refused": "1 when no key can name this instance's KV (blocks no test probed, KV "
                                   "scales computed at run time): it serves, computing every token, and "
                                   "moves no KV (the log says why)",
            "staging_waits": "Converting loads that waited for room in the reader's staging area",
            "staging_full": "Converting loads recomputed for lack of staging room (see the log for sizes; "
                            "raise staging_mib or staging_max_mib)",
            "reads_unstopped": "Reads that had not stopped long after their load failed: the holder was "
                               "disconnected before vLLM got the blocks back",
            "repulls": "Chunks read again from another holder after a read failed (holder dead, frozen past "
                       "its bound, connection refused) or its lock was refused, instead of recomputing them "
                       "(summed over TP ranks: each rank re-pulls its own heads)",
            "publishes_unfenced": "Publishes dropped because the device did not confirm the request's KV "
                                  "writes within publish_fence_wait_s (see the log)",
        }
        for key, doc in docs.items():
            c = self._counter_cls(name=f"vllm:pdxfer_{key}", documentation=doc, labelnames=labelnames)
            self.counters[key] = create_metric_per_engine(c, per_engine_labelvalues)
        h = self._histogram_cls(name="vllm:pdxfer_load_seconds", documentation="Time from posting a "
                                "load to its validated completion", labelnames=labelnames,
                                buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0])
        self.load_seconds = create_metric_per_engine(h, per_engine_labelvalues)
        self.phase_seconds: dict[str, dict[int, Any]] = {}
        for phase in PHASES:
            h = self._histogram_cls(name=f"vllm:pdxfer_phase_{phase}_seconds",
                                    documentation=f"Decode load phase '{phase}' (see pdxfer.vllm.phase_times)",
                                    labelnames=labelnames, buckets=_PHASE_BUCKETS)
            self.phase_seconds[phase] = create_metric_per_engine(h, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            v = int(transfer_stats_data.get(key, 0) or 0)
            if v:
                per_engine[engine_idx].inc(v)
        for t in transfer_stats_data.get("transfer_s", []) or []:
            self.load_seconds[engine_idx].observe(t)
        for phase, per_engine in self.phase_seconds.items():
            for t in transfer_stats_data.get(stats_key(phase), []) or []:
                per_engine[engine_idx].observe(t)
