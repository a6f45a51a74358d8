"""The graders' FAIL rule (`evidence.judge_samples`), vectorised over many simulated runs at once, for null and
power simulations. `test_nulls` checks it against `judge_samples` draw by draw, so a simulation through it says
what the grader would have said."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray
from scipy import stats as sp

from blackbox import evidence, stats

Draws = NDArray[np.float64]  # (runs, samples): deviations from recomputation, inf a confident token flip


def fails(x: Draws, y: Draws, alpha: float, margin: float = evidence.MARGIN) -> NDArray[np.bool_]:
    """Whether `judge_samples` reads each run (subject x[i] against yardstick y[i]) as CorruptionDetected. Noise
    mode only (every yardstick value differs from recomputation, so the count test counts confident flips), and
    arms of at least 10 (below, the shift test is a permutation test). `margin` 1: the same tests at their exact
    level, without the graders' 1.25x (to see what a procedure does to a test that spends all of its alpha)."""
    n1, n2 = x.shape[1], y.shape[1]
    assert min(n1, n2) >= 10, "smaller arms use a permutation test, not simulated here"
    assert bool((y > 0).all()), "an exact yardstick counts differences, not simulated here"
    level = alpha / 3
    return _shift(x, y, level, margin) | exceeds(x, y, level, margin=margin) | count(x, y, level)


def exceeds(
    x: Draws, y: Draws, level: float, ranks: int = evidence.RANKS, margin: float = evidence.MARGIN
) -> NDArray[np.bool_]:
    """The exceedance test over `ranks` thresholds: some x beyond `margin` times y's k-th largest at least its
    critical count (margin 1: the test before the graders put their thresholds at 1.25x)."""
    n1, n2 = x.shape[1], y.shape[1]
    ranks = min(ranks, n2)
    top = margin * -np.sort(-y, axis=1)[:, :ranks]
    beyond = (x[:, :, None] > top[:, None, :]).sum(axis=1)
    critical = [stats.exceedance_critical(n1, n2, level, k, ranks) for k in range(1, ranks + 1)]
    return (beyond >= np.array([n1 + 1 if c is None else c for c in critical])).any(axis=1)


def _shift(x: Draws, y: Draws, level: float, margin: float = evidence.MARGIN) -> NDArray[np.bool_]:
    p = sp.mannwhitneyu(x, margin * y, axis=1, alternative="greater", method="asymptotic").pvalue
    return np.asarray(p < level)


def count(x: Draws, y: Draws, level: float) -> NDArray[np.bool_]:
    n1, n2 = x.shape[1], y.shape[1]
    xc, yc = np.isinf(x).sum(axis=1), np.isinf(y).sum(axis=1)
    critical = {int(c): stats.fisher_critical(n1, n2, int(c), level) for c in np.unique(yc)}
    bound = np.array([n1 + 1 if critical[int(c)] is None else critical[int(c)] for c in yc])
    return np.asarray(xc >= bound)
