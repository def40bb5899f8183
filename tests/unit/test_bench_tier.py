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
