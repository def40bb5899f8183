"""bench/tier.py's trace: the same seed gives the same trace, every request names a prefix of the
working set, and the popularity is skewed as asked (and flat at s = 0)."""

from __future__ import annotations

from collections import Counter

from bench.tier import zipf_trace


def test_the_trace_is_reproducible_and_within_the_working_set():
    a = zipf_trace(16, 400, 1.0, seed=3)
    assert a == zipf_trace(16, 400, 1.0, seed=3)
    assert a != zipf_trace(16, 400, 1.0, seed=4)
    assert len(a) == 400 and set(a) <= set(range(16))


def test_the_popularity_follows_the_skew():
    counts = Counter(zipf_trace(16, 20000, 1.0, seed=0)).most_common()
    # Rank 1 is drawn with weight 1, rank 16 with 1/16: about 16 times as often.
    assert 10 < counts[0][1] / counts[-1][1] < 25, counts
    flat = Counter(zipf_trace(16, 20000, 0.0, seed=0)).most_common()
    assert flat[0][1] / flat[-1][1] < 1.2, flat


def _run(samples):
    s = sorted(samples)
    return {"ttft_ms": {"p99": s[min(len(s) - 1, int(0.99 * len(s)))], "samples": samples}}


def test_the_gate_check_compares_p99_and_each_request_with_its_recomputed_twin():
    from bench.tier import gate_check

    assert gate_check({"on": [_run([1.0])], "off": [_run([1.0])]}, 50.0) is None  # no 'gated' in the run
    off = [_run([100.0, 200.0, 300.0]), _run([120.0, 180.0, 320.0])]
    gated = [_run([40.0, 260.0, 90.0]), _run([60.0, 240.0, 110.0])]
    got = gate_check({"off": off, "gated": gated}, 50.0)
    # p99 of a 3-request run is its slowest request; the medians over the two runs of each.
    assert got["gated_ttft_p99_ms"] == 250.0 and got["off_ttft_p99_ms"] == 310.0
    assert got["p99_ratio"] == round(250 / 310, 3)
    # Request 1: 250 ms gated (median of 260, 240) against 190 ms recomputed: slower by 60 > 50.
    assert got["slower_requests"] == 1 and got["requests"] == 3
    assert gate_check({"off": off, "gated": gated}, 70.0)["slower_requests"] == 0
