"""The tests the graders use, and what a sample of a given size could ever show.

Every test is one-sided in the direction "the treatment is worse". The tests come from scipy.stats; only the
exceedance test is assembled here, because scipy has no test for "a subset of x lies beyond the k-th largest y":
its null is scipy's negative hypergeometric law (checked against permutations in the tests).

Power. A grader asks, before it tests, whether its sample could reach significance at all: for the two-sample
rank, exceedance and Fisher tests the smallest attainable one-sided p-value is 1 / C(n_x + n_y, n_x) (every x
above every y), and for the sign test 2^-n. A grader whose smallest attainable p cannot beat its share of alpha
is not run (`InsufficientPower`), since "no significant difference" from it would mean nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sp

__all__ = [
    "TestResult",
    "conversations_needed",
    "detectable_fraction",
    "each_fraction",
    "either_fraction",
    "exceedance",
    "exceedance_at",
    "exceedance_critical",
    "fisher_critical",
    "fisher_greater",
    "kth_largest",
    "mann_whitney_greater",
    "min_p_sign",
    "min_p_two_sample",
    "ordinal",
    "power_just_beyond",
    "quantile",
    "sign_critical",
    "sign_test",
]

# Below this many values an arm, Mann-Whitney's normal approximation is anti-conservative; enumerate instead.
_EXACT_BELOW = 10


@dataclass(frozen=True)
class TestResult:
    name: str
    statistic: float
    p_value: float
    n: int
    rank: int = 1  # exceedance: the threshold (the reference's rank-th largest) that gave the smallest p

    def describe(self) -> str:
        return f"{self.name}: statistic {self.statistic:.4g}, p = {self.p_value:.3g} (n = {self.n})"


def sign_test(forward: int, reverse: int) -> TestResult:
    """Exact binomial (sign) test that forward flips outnumber reverse flips: P(X >= forward), X ~ Bin(f + r, 1/2).
    Flips are paired outcomes of one conversation, so the sign test is the exact test for them (McNemar's)."""
    n = forward + reverse
    p = sp.binomtest(forward, n, 0.5, alternative="greater").pvalue if n else 1.0
    return TestResult("exact sign test (forward vs reverse flips)", float(forward), float(p), n)


def mann_whitney_greater(x: Sequence[float], y: Sequence[float]) -> TestResult:
    """Mann-Whitney U test that x tends to exceed y (a shift of the whole deviation distribution).

    scipy's exact null distribution has no tie correction, and its normal approximation is anti-conservative for
    small arms, so small samples use a permutation test over the same statistic (exact enumeration where scipy
    can afford it); larger ones the tie-corrected normal approximation with continuity correction."""
    name = "Mann-Whitney U (treatment > reference)"
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0 or len({*x, *y}) == 1:
        return TestResult(name, 0.0, 1.0, n1 + n2)
    if min(n1, n2) < _EXACT_BELOW:
        method: object = sp.PermutationMethod(n_resamples=20_000, random_state=0)
    else:
        method = "asymptotic"
    result = sp.mannwhitneyu(list(x), list(y), alternative="greater", method=method)
    return TestResult(name, float(result.statistic), float(result.pvalue), n1 + n2)


def fisher_greater(a: int, b: int, c: int, d: int) -> TestResult:
    """Fisher's exact test that the rate a/(a+b) exceeds c/(c+d): counts of confident flips or mismatches in two
    independent samples, where the counts are small and no approximation holds."""
    if a + b + c + d == 0:
        return TestResult("Fisher exact (treatment rate > reference rate)", 0.0, 1.0, 0)
    p = sp.fisher_exact([[a, b], [c, d]], alternative="greater").pvalue
    return TestResult("Fisher exact (treatment rate > reference rate)", float(a), min(1.0, float(p)), a + b + c + d)


def exceedance(x: Sequence[float], y: Sequence[float], ranks: int = 1) -> TestResult:
    """Exact test that a subset of x lies beyond the top of y: m_k = #x above y's k-th largest, for k = 1..ranks.

    Under exchangeability, reading the pooled values from the top, the x seen before the k-th y follow a negative
    hypergeometric law (`scipy.stats.nhypergeom(n_x + n_y, n_x, k)`); for k = 1, P(M >= m) = C(n_x, m) /
    C(n_x + n_y, m). Sharper than a rank test when only some x are shifted (a fault that fires in some
    conversations), and it needs no distributional assumption. With ranks > 1 the statistic is the smallest of
    the k p-values, and its own p-value is exact (`_TailNull`), so a few outliers of y cannot set the threshold
    for the run and trying several thresholds costs no false alarms."""
    n1, n2 = len(x), len(y)
    ranks = max(1, min(ranks, n2))
    name = "exceedance (treatment beyond the reference's max)"
    if ranks > 1:
        name = f"exceedance (treatment beyond one of the reference's {ranks} largest)"
    if n1 == 0 or n2 == 0:
        return TestResult(name, 0.0, 1.0, n1 + n2)
    top = sorted(y, reverse=True)[:ranks]
    beyond = [sum(v > t for v in x) for t in top]
    null = _TailNull.of(n1, n2, ranks)
    smallest, best = min((null.p_k[k][m], k) for k, m in enumerate(beyond))
    return TestResult(name, float(beyond[best]), null.p_value(smallest), n1 + n2, rank=best + 1)


def exceedance_at(x: Sequence[float], y: Sequence[float], k: int) -> TestResult | None:
    """The exceedance test at one threshold, y's k-th largest, alone (None when y has fewer than k values)."""
    if len(y) < k or not x:
        return None
    top = kth_largest(y, k)
    m = sum(v > top for v in x)
    p = _TailNull.of(len(x), len(y), k).p_k[k - 1][m]
    return TestResult(f"exceedance (beyond the reference's {ordinal(k)} largest)", float(m), p, len(x) + len(y), k)


def kth_largest(values: Sequence[float], k: int) -> float:
    return sorted(values, reverse=True)[k - 1]


def ordinal(k: int) -> str:
    return f"{k}{'st' if k == 1 else 'nd' if k == 2 else 'rd' if k == 3 else 'th'}"


@dataclass(frozen=True)
class _TailNull:
    """The exact null of the smallest exceedance p-value over the thresholds k = 1..ranks.

    Reading the pooled values from the top, let m_k be the x seen before the k-th y. A path with m_1 <= ... <= m_K
    fixes the first m_K + K labels, so P(m_1 = a_1, ..., m_K = a_K) = C(N - a_K - K, n_x - a_K) / C(N, n_x). The
    smallest p-value min_k P_k(m_k) stays above t exactly when every m_k stays below c_k(t), the least count whose
    p-value is <= t; that probability is a count of nondecreasing paths under the c_k, weighted as above, in exact
    integers. scipy has the marginals (nhypergeom), not this joint law; tests check it against permutations."""

    n1: int
    n2: int
    ranks: int
    p_k: tuple[tuple[float, ...], ...]  # p_k[k-1][m] = P(M_k >= m), m = 0..n1

    @staticmethod
    @functools.lru_cache(maxsize=512)
    def of(n1: int, n2: int, ranks: int) -> _TailNull:
        m = np.arange(n1 + 1)
        # P(M_k >= m) as the tail sum of the closed-form pmf: scipy's nhypergeom.sf sums the pmf anew for each m,
        # which is quadratic in n1; summed from the tail up, small tails keep their precision.
        p_k = tuple(
            tuple(float(v) for v in np.minimum(1.0, np.cumsum(sp.nhypergeom.pmf(m, n1 + n2, n1, k)[::-1])[::-1]))
            for k in range(1, ranks + 1)
        )
        return _TailNull(n1, n2, ranks, p_k)

    def p_value(self, smallest: float) -> float:
        if self.ranks == 1:
            return smallest
        # Counts whose p-value is within rounding of the observed one count as reaching it (conservative).
        cut = smallest * (1 + 1e-9)
        bounds = [next((a for a, p in enumerate(row) if p <= cut), self.n1 + 1) for row in self.p_k]
        paths = [1 if a < bounds[0] else 0 for a in range(self.n1 + 1)]
        for bound in bounds[1:]:
            running, paths = 0, [*paths]
            for a in range(self.n1 + 1):
                running += paths[a]
                paths[a] = running if a < bound else 0
        total, k, n = math.comb(self.n1 + self.n2, self.n1), self.ranks, self.n1 + self.n2
        below = sum(paths[a] * math.comb(n - a - k, self.n1 - a) for a in range(self.n1 + 1) if paths[a])
        return (total - below) / total

    def critical(self, alpha: float, k: int) -> int | None:
        """The fewest x beyond the k-th largest y that reach p < alpha, whatever lies beyond the larger ones."""
        return next((m for m in range(1, self.n1 + 1) if self.p_value(self.p_k[k - 1][m]) < alpha), None)


def min_p_two_sample(n1: int, n2: int) -> float:
    """The smallest one-sided p-value a rank, exceedance or Fisher test of n1 against n2 values can reach."""
    return 1.0 / math.comb(n1 + n2, n1) if n1 and n2 else 1.0


def min_p_sign(n: int) -> float:
    return 0.5**n


def exceedance_critical(n1: int, n2: int, alpha: float, k: int = 1, ranks: int = 1) -> int | None:
    """The fewest x beyond the k-th largest y that the exceedance test over `ranks` thresholds calls significant at
    `alpha`; None if none can."""
    ranks = min(max(ranks, k), n2)
    if n1 == 0 or n2 < k:
        return None
    return _TailNull.of(n1, n2, ranks).critical(alpha, k)


def fisher_critical(n1: int, n2: int, count2: int, alpha: float) -> int | None:
    """The fewest of n1 counted (against `count2` of n2) that Fisher's one-sided test calls significant."""
    return next((a for a in range(1, n1 + 1) if fisher_greater(a, n1 - a, count2, n2 - count2).p_value < alpha), None)


def sign_critical(n: int, alpha: float) -> int | None:
    """The fewest forward flips (no reverse flip) among n paired rows that the sign test calls significant."""
    return next((k for k in range(1, n + 1) if min_p_sign(k) < alpha), None)


def detectable_fraction(n: int, critical: int | None, power: float = 0.95) -> float | None:
    """Smallest fraction q of n units that, if each is independently corrupted with probability q, yields at least
    `critical` corrupted units with probability `power` (binomial tail). None when no fraction can."""
    if critical is None or critical > n:
        return None
    if critical <= 0:
        return 0.0
    # P(Bin(n, q) >= c) is the regularised incomplete beta I_q(c, n - c + 1), increasing in q: the fraction is its
    # quantile at `power` (the identity behind the Clopper-Pearson interval), one scipy call instead of a search.
    return float(sp.beta.ppf(power, critical, n - critical + 1))


def either_fraction(each: float, draws: int) -> float:
    """The fraction of units with at least one of `draws` independent draws corrupted, each with probability
    `each`: 1 - (1 - each)^draws."""
    return 1.0 - (1.0 - each) ** draws


def each_fraction(either: float, draws: int) -> float:
    """The inverse of `either_fraction`: the per-draw fraction that corrupts `either` of the units."""
    return 1.0 - (1.0 - either) ** (1.0 / draws)


def conversations_needed(
    conversations: int,
    units: int,
    alpha: float,
    fraction: float | None = None,
    power: float = 0.95,
    ratio: float = 1.0,
    ranks: int = 1,
) -> int | None:
    """How many conversations a run needs, at the same yield of `units` per conversation and a yardstick `ratio`
    times the subject's size, for a two-sample exceedance test at `alpha` to be able to fail at all (fraction
    None), or to catch corruption in `fraction` of the units with probability `power`. None when even 4096
    conversations would not do. The corruption is taken to lie beyond every value of that run's yardstick; just
    beyond this run's largest it is caught less often, since a larger yardstick reaches further
    (`power_just_beyond`)."""
    yield_ = units / conversations if conversations and units else 0.5

    def enough(n_conv: int) -> bool:
        n = max(1, math.floor(n_conv * yield_))
        crit = exceedance_critical(n, max(1, round(n * ratio)), alpha, ranks=ranks)
        q = detectable_fraction(n, crit, power) if crit is not None and fraction is not None else None
        return crit is not None and (fraction is None or (q is not None and q <= fraction))

    # Doubling, then bisection: each look at a length builds the exceedance test's null for it, which costs more
    # the longer the run, so as few lengths as possible are looked at. The count is a planning figure ("about N").
    lo, hi = 1, max(2, conversations)
    while not enough(hi):
        if hi >= 4096:
            return None
        lo, hi = hi, min(4096, 2 * hi)
    while hi - lo > max(1, lo // 16):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def power_just_beyond(n: int, n_y: int, now: int, alpha: float, fraction: float, ranks: int = 1) -> float:
    """The probability that the exceedance test over `ranks` thresholds, n units against a yardstick of n_y drawn
    anew, catches corruption in `fraction` of the units that lies just beyond the largest of `now` yardstick
    values seen before (this run's). A larger yardstick reaches further: for exchangeable continuous deviations
    the number J of its values beyond the old largest is beta-binomial(n_y, 1, now) (`scipy.stats.betabinom`),
    whatever their distribution, and the corruption clears the (J+1)-th largest and no higher; the corrupted
    count is binomial (`scipy.stats.binom`). A lower bound: clean units beyond the threshold are not counted.
    `conversations_needed` assumes J = 0 (corruption beyond every value of the longer run's yardstick)."""
    beyond = sp.betabinom.pmf(np.arange(ranks), n_y, 1, now)
    caught = 0.0
    for k in range(1, min(ranks, n_y) + 1):
        crit = exceedance_critical(n, n_y, alpha, k, ranks)
        if crit is not None:
            caught += float(beyond[k - 1]) * float(sp.binom.sf(crit - 1, n, fraction))
    return caught


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
