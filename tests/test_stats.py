"""The small tests, against tail probabilities worked out by hand."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from blackbox import stats


def _normal_tail(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


# --- sign test ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("forward", "reverse", "p"),
    [
        (7, 0, 1 / 128),  # P(X >= 7), X ~ Bin(7, 1/2)
        (8, 0, 1 / 256),
        (8, 2, (45 + 10 + 1) / 1024),  # C(10,8) + C(10,9) + C(10,10) over 2^10
        (3, 3, 42 / 64),  # C(6,3) + C(6,4) + C(6,5) + C(6,6) = 20 + 15 + 6 + 1
        (0, 5, 1.0),
    ],
)
def test_sign_test_matches_the_binomial_tail(forward: int, reverse: int, p: float) -> None:
    result = stats.sign_test(forward, reverse)
    assert result.p_value == pytest.approx(p, rel=1e-12)
    assert result.n == forward + reverse
    assert result.statistic == forward


def test_sign_test_without_flips_is_no_evidence() -> None:
    assert stats.sign_test(0, 0).p_value == 1.0


def test_min_flips_detectable_at_one_percent_is_seven() -> None:
    assert stats.min_flips_detectable(0.01) == 7


@pytest.mark.parametrize("alpha", [0.5, 0.2, 0.1, 0.05, 0.01, 1 / 128, 0.005, 0.001])
def test_min_flips_detectable_agrees_with_the_sign_test(alpha: float) -> None:
    # The graders call a result significant when p < alpha, so k flips must clear it and k - 1 must not,
    # including at alphas that are exact powers of 1/2, where p == alpha.
    k = stats.min_flips_detectable(alpha)
    assert stats.sign_test(k, 0).p_value < alpha
    assert k == 1 or stats.sign_test(k - 1, 0).p_value >= alpha


# --- Mann-Whitney ------------------------------------------------------------------------------------------


def _exact_null_variance(x: list[float], y: list[float]) -> float:
    """Var(U) under the permutation null, by enumerating every split: the tie correction's reference value."""
    pooled = [*x, *y]
    ranks = stats._ranks(pooled)
    n1 = len(x)
    us = [sum(ranks[i] for i in idx) - n1 * (n1 + 1) / 2 for idx in itertools.combinations(range(len(pooled)), n1)]
    return statistics.pvariance(us)


def test_mann_whitney_separated_samples() -> None:
    x = [10.0, 11, 12, 13, 14, 15, 16, 17]
    y = [0.0, 1, 2, 3, 4, 5, 6, 7]
    result = stats.mann_whitney_greater(x, y)
    assert result.statistic == 64  # every x beats every y: U = n1 * n2
    # mean 32, variance 8 * 8 * 17 / 12, continuity 0.5
    assert result.p_value == pytest.approx(_normal_tail((64 - 32 - 0.5) / math.sqrt(64 * 17 / 12)), rel=1e-9)
    assert result.p_value < 1e-3
    assert stats.mann_whitney_greater(y, x).p_value > 0.999


def test_mann_whitney_identical_samples_are_not_evidence() -> None:
    same = [0.3, 0.3, 0.3, 0.3]
    assert stats.mann_whitney_greater(same, same).p_value == 1.0  # all tied: zero variance
    varied = [0.1, 0.2, 0.3, 0.4, 0.5]
    result = stats.mann_whitney_greater(varied, list(varied))
    assert result.statistic == pytest.approx(12.5)
    assert result.p_value > 0.5


def test_mann_whitney_with_ties_uses_the_tie_corrected_variance() -> None:
    x = [1.0, 2, 2, 3]
    y = [2.0, 3, 3, 4]
    # Pooled ranks: 1 -> 1, the three 2s -> 3, the three 3s -> 6, 4 -> 8. x's rank sum 13, U = 13 - 10 = 3.
    forward = stats.mann_whitney_greater(x, y)
    assert forward.statistic == pytest.approx(3)
    var = 4 * 4 / 12 * (9 - (24 + 24) / (8 * 7))
    assert var == pytest.approx(_exact_null_variance(x, y))
    assert forward.p_value == pytest.approx(_normal_tail((3 - 8 - 0.5) / math.sqrt(var)), rel=1e-9)
    reverse = stats.mann_whitney_greater(y, x)
    assert reverse.statistic == pytest.approx(13)
    assert reverse.p_value == pytest.approx(_normal_tail((13 - 8 - 0.5) / math.sqrt(var)), rel=1e-9)
    assert reverse.p_value < 0.1 < 0.9 < forward.p_value


def test_mann_whitney_empty_arm() -> None:
    assert stats.mann_whitney_greater([], [1.0, 2.0]).p_value == 1.0
    assert stats.mann_whitney_greater([1.0], []).p_value == 1.0


# --- Fisher ------------------------------------------------------------------------------------------------


def test_fisher_lady_tasting_tea() -> None:
    # Fisher's own table [[3, 1], [1, 3]]: one-sided p = (16 + 1) / 70.
    result = stats.fisher_greater(3, 1, 1, 3)
    assert result.p_value == pytest.approx(17 / 70, rel=1e-12)
    assert result.n == 8


def test_fisher_hand_computed_table() -> None:
    # [[8, 2], [1, 5]]: rows 10/6, first column 9; P(X >= 8) = (C(10,8) C(6,1) + C(10,9) C(6,0)) / C(16,9).
    assert stats.fisher_greater(8, 2, 1, 5).p_value == pytest.approx((45 * 6 + 10) / 11440, rel=1e-12)


def test_fisher_no_excess_is_not_significant() -> None:
    assert stats.fisher_greater(0, 12, 0, 12).p_value == 1.0
    assert stats.fisher_greater(1, 11, 5, 7).p_value > 0.9
    assert stats.fisher_greater(0, 0, 0, 0).p_value == 1.0


# --- quantile ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("q", "expected"), [(0.0, 1.0), (0.5, 2.5), (0.95, 3.85), (1.0, 4.0), (1 / 3, 2.0)])
def test_quantile_interpolates_linearly(q: float, expected: float) -> None:
    assert stats.quantile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_quantile_edge_cases() -> None:
    assert math.isnan(stats.quantile([], 0.5))
    assert stats.quantile([7.0], 0.95) == 7.0


def test_describe_names_the_test_and_the_figures() -> None:
    text = stats.sign_test(7, 0).describe()
    assert "sign test" in text and "p = 0.00781" in text and "n = 7" in text


def test_exceedance_counts_values_beyond_the_others_maximum() -> None:
    result = stats.exceedance([0.9, 0.8, 0.1, 0.2], [0.1, 0.3, 0.25])
    assert result.statistic == 2
    assert result.p_value == pytest.approx(math.comb(4, 2) / math.comb(7, 2))


def test_exceedance_with_nothing_beyond_is_one() -> None:
    assert stats.exceedance([0.1, 0.2], [0.3]).p_value == 1.0
    assert stats.exceedance([], [0.3]).p_value == 1.0


def test_exceedance_is_exact_under_exchangeability() -> None:
    # All orderings of 3 x-values among 6 are equally likely; P(top 2 are both x) = C(3,2)/C(6,2) = 0.2.
    hits = 0
    orders = list(itertools.permutations(range(6)))
    for order in orders:
        x, y = [order[i] for i in range(3)], [order[i] for i in range(3, 6)]
        hits += sum(v > max(y) for v in x) >= 2
    assert hits / len(orders) == pytest.approx(stats.exceedance([5, 4, 0], [1, 2, 3]).p_value)
