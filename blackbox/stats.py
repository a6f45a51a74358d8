"""Small exact and asymptotic tests, in plain Python so the tester carries no numeric stack.

Every test here is one-sided in the direction "the treatment is worse".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TestResult", "exceedance", "fisher_greater", "mann_whitney_greater", "min_flips_detectable", "sign_test"]


@dataclass(frozen=True)
class TestResult:
    name: str
    statistic: float
    p_value: float
    n: int

    def describe(self) -> str:
        return f"{self.name}: statistic {self.statistic:.4g}, p = {self.p_value:.3g} (n = {self.n})"


def sign_test(forward: int, reverse: int) -> TestResult:
    """Exact binomial test that forward flips outnumber reverse flips: P(X >= forward), X ~ Bin(f + r, 1/2)."""
    n = forward + reverse
    p = sum(math.comb(n, k) for k in range(forward, n + 1)) / 2**n if n else 1.0
    return TestResult("exact sign test (forward vs reverse flips)", float(forward), p, n)


def min_flips_detectable(alpha: float) -> int:
    """The fewest forward flips (with no reverse flip) that the sign test calls significant (p < `alpha`)."""
    # 2**-k < alpha strictly: ceil(log2(1/alpha)) is one short when alpha is a power of 1/2.
    return max(1, math.floor(math.log2(1 / alpha)) + 1)


def mann_whitney_greater(x: Sequence[float], y: Sequence[float]) -> TestResult:
    """Mann-Whitney U test that x tends to exceed y; normal approximation with tie and continuity correction.

    Exact enough from ~8 samples an arm; with fewer the p-value is conservative-leaning but still reported.
    """
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return TestResult("Mann-Whitney U (treatment > reference)", 0.0, 1.0, n1 + n2)
    ranks = _ranks([*x, *y])
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    n = n1 + n2
    ties = _tie_term([*x, *y])
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return TestResult("Mann-Whitney U (treatment > reference)", u, 1.0, n)
    z = (u - n1 * n2 / 2 - 0.5) / math.sqrt(var)
    return TestResult("Mann-Whitney U (treatment > reference)", u, 0.5 * math.erfc(z / math.sqrt(2)), n)


def exceedance(x: Sequence[float], y: Sequence[float]) -> TestResult:
    """Exact test that a subset of x lies beyond all of y: m = #x above max(y); under exchangeability
    P(M >= m) = C(n_x, m) / C(n_x + n_y, m). Sharper than a rank test when only some x are shifted (a fault that
    fires in some conversations), and it needs no distributional assumption."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return TestResult("exceedance (treatment beyond the reference's max)", 0.0, 1.0, n1 + n2)
    top = max(y)
    m = sum(v > top for v in x)
    p = math.comb(n1, m) / math.comb(n1 + n2, m)
    return TestResult("exceedance (treatment beyond the reference's max)", float(m), p, n1 + n2)


def fisher_greater(a: int, b: int, c: int, d: int) -> TestResult:
    """Fisher's exact test that the rate a/(a+b) exceeds c/(c+d): P(X >= a) under the hypergeometric law."""
    row1, col1, n = a + b, a + c, a + b + c + d
    if n == 0:
        return TestResult("Fisher exact (treatment rate > reference rate)", 0.0, 1.0, 0)
    denom = math.comb(n, col1)
    top = min(row1, col1)
    p = sum(math.comb(row1, k) * math.comb(n - row1, col1 - k) for k in range(a, top + 1)) / denom
    return TestResult("Fisher exact (treatment rate > reference rate)", float(a), min(1.0, p), n)


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _tie_term(values: Sequence[float]) -> float:
    counts: dict[float, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return float(sum(t**3 - t for t in counts.values()))


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
