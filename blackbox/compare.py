"""How far one answer is from another computed on the same prompt: the statistic every grader shares."""

from __future__ import annotations

import math
from collections.abc import Sequence

from blackbox.history import TokenLogprob

__all__ = ["deviation"]


def deviation(answer: Sequence[TokenLogprob], fresh: Sequence[TokenLogprob], hard_margin: float) -> float:
    """Largest |Δ logprob| over the tokens both sides list (chosen and top-k), at every position up to and
    including the first differing token: the context is still shared there, so a near-tie flip is compared like
    any other position, not dropped. Infinite when the tokens part where recomputation was sure (top-1 margin
    >= `hard_margin`) or the lengths differ: a near-tie flip is noise, a confident one not. NaN logprobs make it
    NaN, which no test may read as small (a gate turns them into an EndpointError first)."""
    worst = 0.0
    for a, b in zip(answer, fresh, strict=False):
        gap = a.gap(b)
        if math.isnan(gap):
            return math.nan
        worst = max(worst, gap)
        if a.token != b.token:
            return math.inf if (b.margin or 0.0) >= hard_margin else worst
    return worst if len(answer) == len(fresh) else math.inf
