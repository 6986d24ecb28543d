"""tasks.common.stats against hand computations."""

from __future__ import annotations

import math

import pytest

from tasks.common.stats import mean_std, ordering_verdict, paired_difference, pooled_std, t_interval


def test_paired_difference_and_interval():
    d = paired_difference({0: 3.0, 1: 5.0, 2: 4.0, 9: 1.0}, {0: 1.0, 1: 2.0, 2: 2.0})
    assert d["seeds"] == [0, 1, 2] and d["diffs"] == [2.0, 3.0, 2.0] and d["n"] == 3
    m, s = 7 / 3, math.sqrt(((2 - 7 / 3) ** 2 * 2 + (3 - 7 / 3) ** 2) / 2)
    assert d["mean"] == pytest.approx(m) and d["std"] == pytest.approx(s)
    half = 4.302652729911275 * s / math.sqrt(3)  # t_{0.975, 2}
    assert d["ci95"] == pytest.approx((m - half, m + half)) and d["excludes_zero"]
    assert not paired_difference({0: 1.0, 1: -1.0}, {0: 0.0, 1: 0.0})["excludes_zero"]
    assert t_interval([1.0]) is None and mean_std([2.0]) == (2.0, 0.0)


def test_ordering_verdict_needs_two_pooled_std():
    assert pooled_std([1.0, 3.0], [2.0, 2.0]) == pytest.approx(1.0)
    assert ordering_verdict([10.0, 10.2, 9.8], [9.0, 9.2, 8.8]) == "holds"   # gap 1, pooled std 0.2
    assert ordering_verdict([10.0, 11.0, 9.0], [9.0, 10.0, 8.0]) == "level"  # gap 1, pooled std 1
    assert ordering_verdict([9.0, 9.2, 8.8], [10.0, 10.2, 9.8]) == "level"   # wrong direction
    assert ordering_verdict([10.0], [1.0]) == "level"                        # no spread: no verdict


def test_ordering_verdict_needs_three_seeds_a_side():
    assert ordering_verdict([10.0, 10.2], [9.0, 9.2]) == "level"             # gap 1, pooled std 0.14, 2 seeds
    assert ordering_verdict([10.0, 10.2, 10.1], [9.0, 9.2]) == "level"
    assert ordering_verdict([10.0, 10.2], [9.0, 9.2], min_seeds=2) == "holds"


def test_ordering_winner_is_two_sided():
    from tasks.common.stats import ordering_winner

    assert ordering_winner([10.0, 10.2, 9.8], [9.0, 9.2, 8.8]) == "a"
    assert ordering_winner([9.0, 9.2, 8.8], [10.0, 10.2, 9.8]) == "b"
    assert ordering_winner([0.20, 0.21, 0.19], [0.30, 0.31, 0.29], higher_is_better=False) == "a"  # a loss
    assert ordering_winner([10.0, 11.0, 9.0], [9.0, 10.0, 8.0]) is None
