"""The load-or-recompute rule (pdxfer.vllm.scheduler.load_benefit): fed observations, asked decisions."""

from __future__ import annotations

import random

import pytest

from pdxfer.vllm.scheduler.load_benefit import LOAD, PARTIAL, RECOMPUTE, BenefitModel, HolderCost, Piece, holder_key

MB = 1 << 20
C = 256  # tokens per chunk
A, B = holder_key("a"), holder_key("b")


def _model(tokens_per_s: float = 10_000.0, steps: int = 4, **kw) -> BenefitModel:
    m = BenefitModel(**kw)
    for _ in range(steps):
        m.observe_step(1000, 1000 / tokens_per_s)
    return m


def _hit(holders: list, chunk_bytes: int = MB) -> list[Piece]:
    return [Piece(h, C, chunk_bytes) for h in holders]


def test_cold_start_loads_everything():
    m = BenefitModel()
    d = m.decide(_hit([A] * 4))
    assert d.kind == LOAD and d.chunks == 4 and "cold start" in d.why
    # Throughput known, but the holder never measured: load, and so measure it.
    m = _model()
    d = m.decide(_hit([A] * 4))
    assert d.kind == LOAD and d.tokens == 4 * C and d.load_all_s is None


def test_slow_holder_is_recomputed():
    m = _model()  # 4 chunks recompute in ~0.1 s
    for _ in range(3):
        m.observe_load(A, 4 * MB, 2.0)  # 4 chunks take 2 s from this holder
    d = m.decide(_hit([A] * 4))
    assert d.kind == RECOMPUTE and d.chunks == 0 and d.declined_tokens == 4 * C
    assert d.load_all_s == pytest.approx(2.0) and d.chosen_s == pytest.approx(4 * C / 10_000)


def test_fast_holder_loads_all():
    m = _model()
    m.observe_load(A, 4 * MB, 0.002)
    d = m.decide(_hit([A] * 4))
    assert d.kind == LOAD and d.chunks == 4 and d.declined_tokens == 0
    assert d.load_all_s < d.recompute_all_s


def test_partial_prefix_when_a_holders_latency_dominates():
    m = _model()  # one chunk recomputes in 25.6 ms
    m.observe_load(A, MB, 0.002)
    m.observe_load(A, 4 * MB, 0.005)
    # b: high fixed latency (0.2 s), fast per byte: the one chunk it has costs more than computing it.
    m.observe_load(B, MB, 0.201)
    m.observe_load(B, 4 * MB, 0.204)
    lat, spb = m.holders[B].fit()
    assert lat == pytest.approx(0.2, rel=1e-3) and spb == pytest.approx(0.001 / MB, rel=1e-3)
    d = m.decide(_hit([A, A, A, B]))
    assert d.kind == PARTIAL and d.chunks == 3 and d.tokens == 3 * C and d.declined_tokens == C
    assert d.chosen_s < d.load_all_s


def test_noise_around_break_even_does_not_flip_the_decision():
    rng = random.Random(7)
    tps = 10_000.0
    break_even = 4 * C / tps  # loading 4 chunks takes about what recomputing them takes
    flips_without_margin = 0
    for trial in range(200):
        kinds = []
        for margin in (0.25, 0.0):
            m = BenefitModel(margin=margin)
            for _ in range(8):
                m.observe_step(1000, 1000 / tps * rng.uniform(0.9, 1.1))
            for _ in range(rng.randint(1, 6)):
                m.observe_load(A, 4 * MB, break_even * rng.uniform(0.85, 1.15))
            kinds.append(m.decide(_hit([A] * 4)).kind)
        assert kinds[0] == LOAD, f"trial {trial}: noise flipped the decision with the margin"
        flips_without_margin += kinds[1] != LOAD
    assert flips_without_margin > 0  # the same noise does flip it without a margin


def test_a_declined_holder_is_measured_again():
    m = _model(probe_every=3)
    m.observe_load(A, 4 * MB, 2.0)
    kinds = [m.decide(_hit([A] * 4)).kind for _ in range(6)]
    assert kinds == [RECOMPUTE, RECOMPUTE, LOAD, RECOMPUTE, RECOMPUTE, LOAD]
    # It got fast: once measured again, it loads.
    for _ in range(16):
        m.observe_load(A, 4 * MB, 0.002)
    assert m.decide(_hit([A] * 4)).kind == LOAD


def test_fit_without_spread_counts_all_time_per_byte():
    c = HolderCost(4)
    assert c.fit() is None and c.expected_s(MB) is None
    c.add(MB, 0.01)
    c.add(MB, 0.03)
    assert c.fit() == pytest.approx((0.0, 0.02 / MB))
    assert c.expected_s(2 * MB) == pytest.approx(0.04)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="margin"):
        BenefitModel(margin=-0.1)
    with pytest.raises(ValueError, match="probe_every"):
        BenefitModel(probe_every=0)


def test_a_holders_host_tier_is_measured_apart_from_its_kv_cache():
    """A chunk a holder serves from host slots (block ids past its device block count) is a
    piece of that holder's host tier: its cost is learnt on its own, so a fast KV cache does not
    vouch for a slow host path, nor the other way round."""
    from types import SimpleNamespace

    from pdxfer.kv.tiers import HOST_LAYOUT_KEY
    from pdxfer.vllm.scheduler.reader_benefit import LoadGate
    from pdxfer.vllm.scheduler.scheduler_state import SchedulerStats

    gate = LoadGate(margin=0.1, stats=SchedulerStats())
    gate.bytes_per_token = MB // C
    with_tier = SimpleNamespace(layout={"num_blocks": 48, "block_size": 16, HOST_LAYOUT_KEY: {}})
    without_tier = SimpleNamespace(layout={"num_blocks": 48, "block_size": 16})
    locs = [SimpleNamespace(node_id="a", block_ids=(3, 4)), SimpleNamespace(node_id="a", block_ids=(48, 49)),
            SimpleNamespace(node_id="b", block_ids=(60, 61))]
    pieces = gate.pieces(locs, {"a": with_tier, "b": without_tier}, local=0, first_chunk=0, chunk_tokens=C,
                         tail_tokens=0, n_full=3, last=3 * C + 5)
    assert [p.holder for p in pieces] == [("a", "device"), ("a", "host"), ("b", "device")]
    assert [p.tokens for p in pieces] == [C, C, C]

    for _ in range(4):
        gate.model.observe_step(1000, 0.1)  # 10,000 tokens/s: a chunk recomputes in 25.6 ms
    for _ in range(3):
        gate.model.observe_load(("a", "device"), MB, 0.001)  # its KV cache: fast
    host_hit = pieces[1:2]
    d = gate.decide("r1", host_hit)
    assert d.kind == LOAD and "never measured" in d.why  # the host path: measure it
    for _ in range(3):
        gate.model.observe_load(("a", "host"), MB, 0.5)  # its host path: far slower than computing
    assert gate.decide("r2", host_hit).kind == RECOMPUTE
    assert gate.decide("r3", pieces[:1]).kind == LOAD  # its KV cache still pays


def test_faster_tier_is_the_one_measured_clearly_faster_for_a_typical_load():
    """What this reader's lookups ask the master to prefer: unknown until both tiers are measured,
    and a tier only when its best holder beats the other tier's best by more than the margin."""
    m = BenefitModel(margin=0.25)
    assert m.faster_tier() is None
    for _ in range(3):
        m.observe_load(("a", "device"), MB, 0.010)
    assert m.faster_tier() is None  # the host tier never measured
    m.observe_load(("b", "host"), MB, 0.009)
    assert m.faster_tier() is None  # 10% apart: inside the margin
    m.observe_load(("c", "host"), MB, 0.004)
    assert m.faster_tier() == "host"  # c's host tier is the best: 4 ms vs 10 ms
    m.observe_load(("d", "device"), MB, 0.001)
    assert m.faster_tier() == "device"


def test_the_gate_tells_lookups_which_tier_to_prefer_once_measured():
    from pdxfer.vllm.scheduler.reader_benefit import LoadGate
    from pdxfer.vllm.scheduler.scheduler_state import SchedulerStats

    gate = LoadGate(margin=0.1, stats=SchedulerStats())
    assert gate.preferred_tier is None
    for i, (holder, s) in enumerate([(("a", "device"), 0.02), (("b", "host"), 0.005)]):
        req = f"r{i}"
        gate.planned(req, [Piece(holder, C, MB)])
        gate.step_built(None, [req], now=10.0 * i)
        gate.step_output([req], now=10.0 * i + s)
    assert gate.preferred_tier == "host"


def test_per_token_costs_are_a_typical_load_from_each_tiers_best_holder():
    """What the gate exports for a router (vllm:pdxfer_load_benefit_*_seconds_per_token): per
    tier, a typical load's expected time from its best measured holder over the tokens it
    carries; per instance, 1 / prefill throughput. Nothing until measured."""
    m = BenefitModel()
    tok = MB // C  # KV bytes per token: a chunk is 1 MiB
    assert m.load_s_per_token(tok) == {} and m.compute_s_per_token() is None
    m.observe_load(("a", "device"), MB, 0.010)
    m.observe_load(("b", "host"), MB, 0.040)
    m.observe_load(("c", "host"), MB, 0.020)  # the better host holder is the one that counts
    costs = m.load_s_per_token(tok)
    assert costs == pytest.approx({"device": 0.010 / C, "host": 0.020 / C})
    assert m.load_s_per_token(0) == {}  # the KV bytes per token not known yet: no guess
    # A typical load is the mean of the measured sizes (here 1.75 MiB): latency is spread over it.
    m.observe_load(("a", "device"), 4 * MB, 0.010)
    lat, spb = m.holders[("a", "device")].fit()
    typical = (MB * 3 + 4 * MB) // 4
    assert m.load_s_per_token(tok)["device"] == pytest.approx((lat + spb * typical) / (typical / tok))
    for _ in range(3):
        m.observe_step(1000, 0.1)
    assert m.compute_s_per_token() is None  # 3 of min_steps=4 prefill steps
    m.observe_step(1000, 0.1)
    assert m.compute_s_per_token() == pytest.approx(1e-4)  # 10,000 tokens/s


def test_the_gate_sets_its_cost_gauges_when_it_measures():
    """The gauges start at 0 (not measured), the compute cost follows prefill steps, the load
    costs follow loads; a host tier measured slower per token than computing reads so."""
    from pdxfer.contracts.connector_metric_defs import COMPUTE_COST_KEY, COST_KEYS, LOAD_COST_KEYS
    from pdxfer.vllm.scheduler.reader_benefit import LoadGate
    from pdxfer.vllm.scheduler.scheduler_state import SchedulerStats

    gate = LoadGate(margin=0.1, stats=SchedulerStats())
    gate.bytes_per_token = MB // C
    assert gate.gauges() == dict.fromkeys(COST_KEYS, 0.0)
    for i in range(4):  # prefill steps of 1000 tokens in 0.1 s: 1e-4 s per token
        gate.step_built({"p": 1000}, [], now=float(i))
        gate.step_output(None, now=i + 0.1)
    assert gate.gauges()[COMPUTE_COST_KEY] == pytest.approx(1e-4)
    assert gate.gauges()[LOAD_COST_KEYS["host"]] == 0.0
    for i, (holder, s) in enumerate([(("a", "device"), 0.001), (("b", "host"), 0.5)]):
        gate.planned(f"r{i}", [Piece(holder, C, MB)])
        gate.step_built(None, [f"r{i}"], now=10.0 + i)
        gate.step_output([f"r{i}"], now=10.0 + i + s)
    g = gate.gauges()
    assert g[LOAD_COST_KEYS["device"]] == pytest.approx(0.001 / C)
    assert g[LOAD_COST_KEYS["host"]] == pytest.approx(0.5 / C)
    assert g[LOAD_COST_KEYS["host"]] > g[COMPUTE_COST_KEY] > g[LOAD_COST_KEYS["device"]]
