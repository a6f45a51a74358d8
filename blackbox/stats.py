"""The tests the graders use, and what a sample of a given size could ever show.

Every test is one-sided in the direction "the treatment is worse". The tests come from scipy.stats; only the
exceedance test is written here, because scipy has no test for "a subset of x lies beyond every y" (it is checked
against an enumeration of permutations in the tests).

Power. A grader asks, before it tests, whether its sample could reach significance at all: for the two-sample
rank, exceedance and Fisher tests the smallest attainable one-sided p-value is 1 / C(n_x + n_y, n_x) (every x
above every y), and for the sign test 2^-n. A grader whose smallest attainable p cannot beat its share of alpha
is not run (`InsufficientPower`), since "no significant difference" from it would mean nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats as sp

__all__ = [
    "TestResult",
    "conversations_needed",
    "detectable_fraction",
    "exceedance",
    "exceedance_critical",
    "fisher_critical",
    "fisher_greater",
    "mann_whitney_greater",
    "min_p_sign",
    "min_p_two_sample",
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


def exceedance(x: Sequence[float], y: Sequence[float]) -> TestResult:
    """Exact test that a subset of x lies beyond all of y: m = #x above max(y); under exchangeability
    P(M >= m) = C(n_x, m) / C(n_x + n_y, m). Sharper than a rank test when only some x are shifted (a fault that
    fires in some conversations), and it needs no distributional assumption."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return TestResult("exceedance (treatment beyond the reference's max)", 0.0, 1.0, n1 + n2)
    top = max(y)
    m = sum(v > top for v in x)
    return TestResult("exceedance (treatment beyond the reference's max)", float(m), _exceed_p(n1, n2, m), n1 + n2)


def _exceed_p(n1: int, n2: int, m: int) -> float:
    return math.comb(n1, m) / math.comb(n1 + n2, m)


def min_p_two_sample(n1: int, n2: int) -> float:
    """The smallest one-sided p-value a rank, exceedance or Fisher test of n1 against n2 values can reach."""
    return 1.0 / math.comb(n1 + n2, n1) if n1 and n2 else 1.0


def min_p_sign(n: int) -> float:
    return 0.5**n


def exceedance_critical(n1: int, n2: int, alpha: float) -> int | None:
    """The fewest x beyond max(y) that the exceedance test calls significant at `alpha`; None if none can."""
    return next((m for m in range(1, n1 + 1) if _exceed_p(n1, n2, m) < alpha), None)


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
    lo, hi = 0.0, 1.0
    if sp.binom.sf(critical - 1, n, hi) < power:
        return None
    for _ in range(40):  # bisection on a monotone tail
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sp.binom.sf(critical - 1, n, mid) < power else (lo, mid)
    return hi


def conversations_needed(
    conversations: int,
    units: int,
    alpha: float,
    fraction: float | None = None,
    power: float = 0.95,
    ratio: float = 1.0,
) -> int | None:
    """How many conversations a run needs, at the same yield of `units` per conversation and a yardstick `ratio`
    times the subject's size, for a two-sample exceedance test at `alpha` to be able to fail at all (fraction
    None), or to catch corruption in `fraction` of the units with probability `power`. None when even 4096
    conversations would not do."""
    yield_ = units / conversations if conversations and units else 0.5
    n_conv = max(2, conversations)
    while n_conv <= 4096:
        n = max(1, math.floor(n_conv * yield_))
        crit = exceedance_critical(n, max(1, round(n * ratio)), alpha)
        q = detectable_fraction(n, crit, power) if crit is not None and fraction is not None else None
        if crit is not None and (fraction is None or (q is not None and q <= fraction)):
            return n_conv
        n_conv += max(1, n_conv // 16)  # coarse steps: the answer is a planning figure, "about N"
    return None


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
