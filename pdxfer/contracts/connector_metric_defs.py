"""The connector's Prometheus metrics, as definitions (no vLLM import): what each vLLM instance's
``/metrics`` shows under ``vllm:pdxfer_*``. ``connector_stats`` builds the metrics from these, and
``docs/metrics.md`` is generated from them.

Counters are summed over the scheduler and every worker (TP ranks); gauges are the scheduler's
latest values; histograms take every sample."""

from __future__ import annotations

from pdxfer.kv.tiers import TIERS
from pdxfer.common.metric_defs import MetricDef
from pdxfer.contracts.phase_times import PHASES

# vLLM labels every metric of an engine with these (vllm.v1.metrics.loggers).
LABELS = ("model_name", "engine")

# (stats key, help): the counter is vllm:pdxfer_<key>_total.
_COUNTER_HELP = (
    ("loads_ok", "KV loads validated at release"),
    ("loads_failed", "KV loads that failed and were recomputed"),
    ("tokens_loaded", "Prompt tokens whose KV was read from a holder"),
    ("bytes_loaded", "KV bytes read from holders"),
    ("lookups", "Master lookups this instance made for its requests' prompts"),
    ("hit_exists_tokens", "Hit funnel, 1 of 4 (exists): prompt tokens beyond this instance's prefix cache "
                          "known published when it looked them up (its prefill's publish hint, or the "
                          "master's answer); the last prompt token is never counted (always computed)"),
    ("hit_visible_tokens", "Hit funnel, 2 of 4 (visible): ... of those, the tokens the master's lookup "
                           "answer held (short of exists: published too late, or the holder unusable here)"),
    ("lookup_hit_tokens", "Hit funnel, 3 of 4 (selected): ... of those, the tokens this instance chose to "
                          "load (short of visible: the load gate, a holder whose layout it cannot read); "
                          "4 of 4 (loaded) is tokens_loaded"),
    ("published_chunks", "Chunks published to the pdxfer master"),
    ("freed_chunks", "Held chunks returned to the block pool"),
    ("pressure_reclaims", "Held chunks unpublished early to keep held blocks under the cap "
                          "(max_held_fraction of the KV cache)"),
    ("chunks_over_cap", "Computed chunks left unpublished: held blocks were at the cap (max_held_fraction) and "
                        "the host tier had no room for them (or is off)"),
    ("holder_refused_connections", "TCP holder: connections closed at accept, every slot held by an authenticated "
                                   "reader (max_connections)"),
    ("holder_evicted_handshakes", "TCP holder: connections still in their handshake cut for a newcomer (at "
                                  "max_connections, or over max_handshakes_per_peer for one peer address)"),
    ("holder_auth_failures", "TCP holder: connections whose peer failed the proof of the holder's secret (a "
                             "stale or a guessed secret, or no pdxfer frame)"),
    ("holder_handshake_timeouts", "TCP holder: connections that did not finish their handshake within "
                                  "hello_timeout of accept (silent or trickling peers)"),
    ("late_publishes", "Publishes still in flight when their request's wait for them ran out"),
    ("load_benefit_loads", "Hits the load gate (load_benefit) loaded whole: loading was expected to be faster"),
    ("load_benefit_partials", "Hits the load gate loaded only a leading part of, computing the rest here"),
    ("load_benefit_recomputes", "Hits the load gate declined entirely: computing them was expected to be faster"),
    ("load_benefit_declined_tokens", "Held prompt tokens the load gate chose to compute rather than load"),
    ("master_errors", "Master calls that failed on the scheduler hot path"),
    ("unkeyable_requests", "Requests kept out of the connector: their KV is not named by their "
                           "tokens (LoRA, multimodal inputs, prompt embeddings)"),
    ("background_errors", "Unexpected errors the holder's reaper or publisher survived (see the log)"),
    ("publish_hint_waits", "Decode lookups that waited for chunks their prefill's hint announced"),
    ("publish_hint_timeouts", "... that went on without some of them (the publish came too late)"),
    ("kv_transfer_refused", "1 when no key can name this instance's KV (blocks no test probed, KV "
                            "scales computed at run time): it serves, computing every token, and "
                            "moves no KV (the log says why)"),
    ("staging_waits", "Converting loads that waited for room in the reader's staging area"),
    ("staging_full", "Converting loads recomputed for lack of staging room (see the log for sizes; "
                     "raise staging_mib or staging_max_mib)"),
    ("reads_unstopped", "Reads that had not stopped long after their load failed: the holder was "
                        "disconnected before vLLM got the blocks back"),
    ("repulls", "Chunks read again from another holder after a read failed (holder dead, frozen past "
                "its bound, connection refused) or its lock was refused, instead of recomputing them "
                "(summed over TP ranks: each rank re-pulls its own heads)"),
    ("publishes_unfenced", "Publishes dropped because the device did not confirm the request's KV "
                           "writes within publish_fence_wait_s (see the log)"),
    ("host_tier_tokens_loaded", "Prompt tokens of loads that read chunks from a holder's host tier "
                                "(host_tier_mib on the holder); part of tokens_loaded"),
    ("offloads_queued", "Host-tier copies queued: a finished request's new chunk copied from KV cache "
                        "blocks into host slots (host_tier_mib)"),
    ("offloads_completed", "Host-tier copies every TP rank completed (the chunk can move to host memory)"),
    ("offloads_failed", "Host-tier copies that failed on a TP rank or went unanswered (see the log); "
                        "their chunks are unpublished as without a host tier"),
    ("host_moves", "Chunks whose master entry moved to their host copy when their KV cache blocks were "
                   "released (retention over, cap pressure)"),
    ("host_evictions", "Host-only chunks unpublished (least recently used first) to make room in the "
                       "host pool"),
    ("bytes_loaded_full", "Hybrid models: KV bytes of full-attention groups read from holders (part of "
                          "bytes_loaded)"),
    ("bytes_loaded_sliding", "Hybrid models: KV bytes of sliding-window groups read from holders, only the "
                             "window before each hit (part of bytes_loaded)"),
    ("bytes_loaded_state", "Hybrid models: bytes of the blocks holding recurrent groups' state (Mamba, gated "
                           "delta-net) read from holders, one block per group and hit (part of bytes_loaded)"),
    ("hybrid_hits_cut", "Hybrid models: hits cut short (or to nothing) because a sliding window's blocks "
                        "before them were no longer held, or no holder's recurrent state ended there"),
)

# (stats key, help): the gauge is vllm:pdxfer_<key>. vLLM ships connector stats with an engine
# step's output, so these move only when the engine steps (blocks a holder let go are returned
# to vLLM's pool at that step too).
_GAUGE_HELP = (
    ("held_blocks", "KV cache blocks this instance holds for readers (published chunks)"),
    ("held_chunks", "Published chunks this instance holds for readers, as of its engine's last step "
                    "(an idle engine reports the count of its last step)"),
    ("held_blocks_cap", "The most blocks it may hold: max_held_fraction of its KV cache's blocks "
                        "(0 on an instance that does not publish)"),
    ("host_chunks", "Chunks this instance serves from host memory only (host tier)"),
    ("host_slots_used", "Host-tier slots in use: host-only chunks and copies of held chunks"),
)

COUNTER_KEYS = tuple(k for k, _ in _COUNTER_HELP)
GAUGE_KEYS = tuple(k for k, _ in _GAUGE_HELP)

# What the load gate (load_benefit) measured, per prompt token: seconds, so float gauges (the
# held_* ones above are counts). 0 means not measured (yet): load_benefit off, no load from that
# tier, too few prefill steps, or the instance restarted; a router must read 0 as "unknown".
# Stats key per tier, and the key of this instance's own prefill cost.
LOAD_COST_KEYS = {tier: f"load_benefit_{tier}_s_per_token" for tier in TIERS}
COMPUTE_COST_KEY = "load_benefit_compute_s_per_token"
COST_KEYS = (*LOAD_COST_KEYS.values(), COMPUTE_COST_KEY)
LOAD_COST = MetricDef("vllm:pdxfer_load_benefit_load_seconds_per_token", "gauge",
                      "Load gate (load_benefit): expected seconds per prompt token of a typical load "
                      "of this reader (the mean size of its measured loads) from the best holder it "
                      "measured in that tier (device: KV cache, host: host tier); 0 until measured",
                      LABELS + ("tier",))
COMPUTE_COST = MetricDef("vllm:pdxfer_load_benefit_compute_seconds_per_token", "gauge",
                         "Load gate (load_benefit): seconds this instance takes to prefill one prompt "
                         "token (1 / its measured prefill throughput); 0 until measured", LABELS)

LOAD_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

COUNTERS = tuple(MetricDef(f"vllm:pdxfer_{k}", "counter", h, LABELS) for k, h in _COUNTER_HELP)
GAUGES = tuple(MetricDef(f"vllm:pdxfer_{k}", "gauge", h, LABELS) for k, h in _GAUGE_HELP)
LOAD_SECONDS = MetricDef("vllm:pdxfer_load_seconds", "histogram",
                         "Time from posting a load to its validated completion", LABELS)
OFFLOAD_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OFFLOAD_SECONDS = MetricDef("vllm:pdxfer_offload_seconds", "histogram",
                            "Host-tier copies: time from queueing the copy to every TP rank reporting it "
                            "complete (from then on the chunk can outlive its KV cache blocks)", LABELS)
PHASE_SECONDS = {p: MetricDef(f"vllm:pdxfer_phase_{p}_seconds", "histogram",
                              f"Time of a decode load's '{p}' phase (phases in docs/metrics.md)", LABELS)
                 for p in PHASES}

CONNECTOR_METRICS: tuple[MetricDef, ...] = (COUNTERS + GAUGES + (LOAD_COST, COMPUTE_COST)
                                             + (LOAD_SECONDS, OFFLOAD_SECONDS)
                                             + tuple(PHASE_SECONDS.values()))
