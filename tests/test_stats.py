"""The small tests, against tail probabilities worked out by hand."""

from __future__ import annotations

import itertools
import math
import random

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


def test_sign_critical_is_seven_at_one_percent() -> None:
    assert stats.sign_critical(20, 0.01) == 7
    assert stats.sign_critical(6, 0.01) is None  # six rows cannot reach p < 0.01 even if all flip


@pytest.mark.parametrize("alpha", [0.5, 0.2, 0.1, 0.05, 0.01, 1 / 128, 0.005, 0.001])
def test_sign_critical_agrees_with_the_sign_test(alpha: float) -> None:
    # The graders call a result significant when p < alpha, so k flips must clear it and k - 1 must not,
    # including at alphas that are exact powers of 1/2, where p == alpha.
    k = stats.sign_critical(64, alpha)
    assert k is not None
    assert stats.sign_test(k, 0).p_value < alpha
    assert k == 1 or stats.sign_test(k - 1, 0).p_value >= alpha


# --- Mann-Whitney ------------------------------------------------------------------------------------------


def stats_ranks(values: list[float]) -> list[float]:
    """Mid-ranks, by hand: the reference the scipy-backed statistic is checked against."""
    return [sum(w < v for w in values) + (sum(w == v for w in values) + 1) / 2 for v in values]


def test_mann_whitney_small_arms_are_exact() -> None:
    # Every x beats every y: the permutation p is 1 / C(8, 4) = 1/70, which the normal approximation overstates.
    result = stats.mann_whitney_greater([10.0, 11, 12, 13], [0.0, 1, 2, 3])
    assert result.statistic == 16
    assert result.p_value == pytest.approx(1 / 70, rel=1e-9)
    assert stats.mann_whitney_greater([0.0, 1, 2, 3], [10.0, 11, 12, 13]).p_value == pytest.approx(1.0)


def test_mann_whitney_small_arms_hold_their_level_under_the_null() -> None:
    # The reason small arms are not approximated: the rate of p < 0.005 over exchangeable data must stay at or
    # below 0.005 (the review found the normal approximation at 0.010 for n = 8, 27 with shared noise).
    rng = random.Random(3)
    trials = 400
    hits = sum(
        stats.mann_whitney_greater([rng.random() for _ in range(5)], [rng.random() for _ in range(6)]).p_value < 0.05
        for _ in range(trials)
    )
    assert hits / trials <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)


def test_mann_whitney_large_arms_use_the_tie_corrected_normal_approximation() -> None:
    x = [float(v) for v in range(10, 30)]
    y = [float(v) for v in range(0, 20)]
    result = stats.mann_whitney_greater(x, y)
    ranks = stats_ranks([*x, *y])
    u = sum(ranks[:20]) - 20 * 21 / 2
    ties = 10 * (2**3 - 2)  # ten values appear twice
    var = 20 * 20 / 12 * (41 - ties / (40 * 39))
    assert result.statistic == pytest.approx(u)
    assert result.p_value == pytest.approx(_normal_tail((u - 200 - 0.5) / math.sqrt(var)), rel=1e-6)


def test_mann_whitney_identical_samples_are_not_evidence() -> None:
    same = [0.3, 0.3, 0.3, 0.3]
    assert stats.mann_whitney_greater(same, same).p_value == 1.0
    varied = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert stats.mann_whitney_greater(varied, list(varied)).p_value > 0.5


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


# --- power -------------------------------------------------------------------------------------------------


def test_the_smallest_two_sample_p_is_one_over_the_splits() -> None:
    assert stats.min_p_two_sample(3, 3) == pytest.approx(1 / 20)
    assert stats.min_p_two_sample(5, 5) == pytest.approx(1 / 252)
    assert stats.min_p_two_sample(0, 5) == 1.0
    # It is what the tests reach when every x lies beyond every y.
    x, y = [5.0, 6, 7], [1.0, 2, 3]
    assert stats.exceedance(x, y).p_value == pytest.approx(stats.min_p_two_sample(3, 3))
    assert stats.fisher_greater(3, 0, 0, 3).p_value == pytest.approx(stats.min_p_two_sample(3, 3))


def test_exceedance_critical_is_the_first_significant_count() -> None:
    m = stats.exceedance_critical(24, 24, 0.01 / 6)
    assert m is not None
    assert stats.exceedance([1.0] * m + [0.0] * (24 - m), [0.5] * 24).p_value < 0.01 / 6
    assert stats.exceedance([1.0] * (m - 1) + [0.0] * (25 - m), [0.5] * 24).p_value >= 0.01 / 6
    assert stats.exceedance_critical(3, 3, 0.01) is None


def test_detectable_fraction_reaches_the_stated_power_by_simulation() -> None:
    n, critical = 30, 8
    q = stats.detectable_fraction(n, critical, 0.95)
    assert q is not None and 0 < q < 1
    rng = random.Random(0)
    trials = 4000
    caught = sum(sum(rng.random() < q for _ in range(n)) >= critical for _ in range(trials)) / trials
    assert caught == pytest.approx(0.95, abs=0.015)
    below = sum(sum(rng.random() < q * 0.8 for _ in range(n)) >= critical for _ in range(trials)) / trials
    assert below < 0.93
    assert stats.detectable_fraction(5, None) is None
    assert stats.detectable_fraction(5, 6) is None


def test_conversations_needed_grows_with_the_target() -> None:
    level = 0.01 / 6
    can_fail = stats.conversations_needed(4, 3, level)
    for20, for10 = stats.conversations_needed(32, 24, level, 0.2), stats.conversations_needed(32, 24, level, 0.1)
    assert can_fail is not None and for20 is not None and for10 is not None
    assert 4 < can_fail < for20 < for10
    n = can_fail * 3 // 4  # the same yield of 3 hits per 4 conversations
    assert stats.min_p_two_sample(n, n) < level


def test_a_larger_yardstick_needs_fewer_conversations() -> None:
    level = 0.01 / 6
    alike = stats.conversations_needed(32, 31, level, 0.2)
    double = stats.conversations_needed(32, 31, level, 0.2, ratio=2.0)
    assert alike is not None and double is not None and double < alike
    assert stats.exceedance_critical(31, 62, level) == 6 < stats.exceedance_critical(31, 31, level) == 9  # type: ignore[operator]


# --- exceedance over several thresholds ---------------------------------------------------------------------


def test_one_threshold_is_the_closed_form() -> None:
    result = stats.exceedance([0.9, 0.8, 0.7, 0.1], [0.5, 0.4, 0.3, 0.2, 0.05], ranks=1)
    assert (result.statistic, result.rank) == (3, 1)
    assert result.p_value == pytest.approx(math.comb(4, 3) / math.comb(9, 3))


def test_the_best_of_several_thresholds_is_exact_under_exchangeability() -> None:
    # Every split of 9 distinct values into 4 x and 5 y is equally likely under the null; the test's p-value at
    # each attainable statistic must equal the share of splits whose p-value is at most it.
    values = list(range(9))
    ps = []
    for xs in itertools.combinations(values, 4):
        ys = [v for v in values if v not in xs]
        ps.append(stats.exceedance(list(xs), ys, ranks=3).p_value)
    for p in set(ps):
        assert sum(q <= p for q in ps) / len(ps) == pytest.approx(p)
    assert min(ps) == pytest.approx(1 / math.comb(9, 4))


def test_several_thresholds_hold_their_level_against_a_permutation() -> None:
    rng = random.Random(7)
    pooled = [rng.random() for _ in range(60)]
    draws, level, below = 4000, 0.05, 0
    for _ in range(draws):
        rng.shuffle(pooled)
        below += stats.exceedance(pooled[:20], pooled[20:], ranks=4).p_value <= level
    assert below / draws <= level + 3 * math.sqrt(level * (1 - level) / draws)
    assert below / draws >= level / 2  # not grossly conservative either


def test_a_reference_outlier_does_not_blind_the_deeper_thresholds() -> None:
    reference = [0.1 + 0.001 * i for i in range(126)] + [0.3, 0.9]  # 128, one outlier at 0.9
    treatment = [0.05] * 54 + [0.5] * 10  # ten hits beyond all but the outlier
    single, best = stats.exceedance(treatment, reference), stats.exceedance(treatment, reference, ranks=4)
    assert single.statistic == 0 and single.p_value == 1.0
    assert best.rank == 2 and best.statistic == 10
    assert best.p_value < 0.005 / 3 < single.p_value


def test_the_critical_count_of_several_thresholds() -> None:
    level = 0.005 / 3
    for k in (1, 4):
        m = stats.exceedance_critical(64, 128, level, k, ranks=4)
        assert m is not None
        reference = [float(i) for i in range(128)]
        top = reference[-k]  # k-th largest
        hits = [top + 1.0] * m + [0.0] * (64 - m)
        fewer = [top + 1.0] * (m - 1) + [0.0] * (65 - m)
        assert stats.exceedance(hits, reference, ranks=4).p_value < level
        assert stats.exceedance(fewer, reference, ranks=4).p_value >= level
    # trying four thresholds costs one hit beyond the largest at 64 against 128
    assert stats.exceedance_critical(64, 128, level, ranks=4) == stats.exceedance_critical(64, 128, level) + 1  # type: ignore[operator]
