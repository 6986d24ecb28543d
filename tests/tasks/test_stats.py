"""tasks.common.stats against hand computations."""

from __future__ import annotations

import math

import pytest

from tasks.common import stats
from tasks.common.stats import (mean_std, ordering_verdict, ordering_word, paired_difference, pooled_std,
                                t_interval)


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


def test_ordering_word_says_which_side_is_ahead():
    assert ordering_word([10.0, 10.2, 9.8], [9.0, 9.2, 8.8]) == "holds"
    assert ordering_word([9.0, 9.2, 8.8], [10.0, 10.2, 9.8]) == "reversed"   # b ahead: said, not hidden
    assert ordering_word([10.0, 11.0, 9.0], [9.0, 10.0, 8.0]) == "level"
    assert ordering_word([9.0, 9.2, 8.8], [10.0, 10.2, 9.8], higher_is_better=False) == "holds"  # losses


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


def test_mcnemar_counts_and_exact_p():
    # 10 examples only a gets right, none only b: p = 2 * 0.5 ** 10 (two-sided exact binomial)
    a = [True] * 10 + [True] * 80 + [False] * 10
    b = [False] * 10 + [True] * 80 + [False] * 10
    m = stats.mcnemar(a, b)
    counts = (m["n"], m["only_a_right"], m["only_b_right"], m["both_right"], m["both_wrong"])
    assert counts == (100, 10, 0, 80, 10)
    assert m["p"] == pytest.approx(2 * 0.5 ** 10)
    # an even split of the disagreements is no evidence either way; no disagreement at all gives p = 1
    assert stats.mcnemar([True, False] * 5, [False, True] * 5)["p"] == pytest.approx(1.0)
    assert stats.mcnemar(a, a)["p"] == 1.0 and stats.mcnemar(a, a)["only_a_right"] == 0
    # the examples both get right do not move p: only the disagreements count
    assert stats.mcnemar(a + [True] * 500, b + [True] * 500)["p"] == pytest.approx(m["p"])
    with pytest.raises(ValueError, match="same ones"):
        stats.mcnemar(a, b[:-1])


def test_accuracy_se_is_binomial():
    assert stats.accuracy_se(0.99, 10_000) == pytest.approx(math.sqrt(0.99 * 0.01 / 10_000))
    assert stats.accuracy_se(1.0, 50) == 0.0


def test_convergence_word_is_the_written_rule():
    # table2_converged's softmax: last-epoch gains 0.07 / 0.05 / 0.00 (mean 0.04) above its seed std 0.030
    softmax = [99.21, 99.24, 99.18]
    assert stats.convergence_word([0.07, 0.05, 0.00], softmax) == "still gaining"
    assert stats.convergence_word([0.02, 0.01, 0.00], softmax) == "converged"
    # a loss improves downwards: a negative change is a gain
    assert stats.convergence_word([-0.5, -0.4, -0.6], [2.0, 2.1, 1.9], higher_is_better=False) == "still gaining"
    assert stats.convergence_word([0.5, 0.4, 0.6], [2.0, 2.1, 1.9], higher_is_better=False) == "converged"
    # two seeds decide nothing (the 5-epoch softmax: 0.21 / 0.17 against a std of 0.20 would have passed) ...
    assert stats.convergence_word([0.21, 0.17], [98.84, 99.12]) == "-"
    # ... unless no seed moved at all (a plateau, e.g. at 100%)
    assert stats.convergence_word([0.0, 0.0], [100.0, 100.0]) == "converged"
    assert "standard deviation" in stats.CONVERGENCE_RULE
