"""The statistics of bench/mps_latency.py (issue 26): nearest-rank quantiles and the interval for a
median of paired rounds, against figures worked out by hand and a simulation."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from mps_latency import median_interval, quantile  # noqa: E402


def test_nearest_rank_quantiles() -> None:
    # p99 of 1..1000 is the 990th value; of 1..150 the ceil(148.5) = 149th; p50 of 1..4 the 2nd.
    assert quantile(list(range(1, 1001)), 0.99) == 990
    assert quantile(list(range(1, 151)), 0.99) == 149
    assert quantile([1, 2, 3, 4], 0.5) == 2
    assert quantile([7.0], 0.999) == 7.0


@pytest.mark.parametrize(("n", "lo", "hi", "coverage"), [
    # [x(k+1), x(n-k)] covers 1 - 2 P(Bin(n, 1/2) <= k); the narrowest with at least 90 %:
    (8, 2, 7, 1 - 2 * (1 + 8) / 256),       # k = 1: 0.930 (k = 2 would give 0.711)
    (10, 2, 9, 1 - 2 * (1 + 10) / 1024),    # k = 1: 0.979 (k = 2 would give 0.891)
    (6, 1, 6, 1 - 2 * 1 / 64),              # only min..max reaches 90 %: 0.969
    (4, 1, 4, 1 - 2 * 1 / 16),              # too few rounds for 90 %: min..max, 0.875
])
def test_median_interval_by_hand(n: int, lo: int, hi: int, coverage: float) -> None:
    values = [10.0 * i for i in range(n, 0, -1)]  # unordered on purpose
    median, low, high, cover = median_interval(values)
    assert median == statistics.median(values)
    assert (low, high) == (10.0 * lo, 10.0 * hi)
    assert cover == pytest.approx(coverage)


def test_median_interval_covers_the_true_median_as_often_as_it_says() -> None:
    rng = random.Random(26)
    trials, hits = 4000, 0
    for _ in range(trials):
        # a skewed distribution whose median is known: exponential, median ln 2
        _, low, high, cover = median_interval([rng.expovariate(1.0) for _ in range(8)])
        hits += low <= 0.6931471805599453 <= high
    assert cover == pytest.approx(0.9296875)
    assert abs(hits / trials - cover) < 0.02
