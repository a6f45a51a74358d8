"""Liveness gates: proof that the trigger fired, checked before any grader is believed.

A gate that fails turns the run UNKNOWN with its own class; a run that tested nothing is never PASS. The gates
here hold for every probe (every request answered, with finite logprobs; no counter reset; the cache hit at all);
each probe adds its own trigger proof (`Probe.gates`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from blackbox import errors, metrics
from blackbox.config import Grading
from blackbox.history import Arm, History
from blackbox.probes import selected
from blackbox.probes.multiturn import (
    decode_region_hits,
    drafter_live,
    in_decode_region,
    in_prefill_region,
    reaches_decode_region,
    trigger,
)
from blackbox.verdict import Finding

__all__ = [
    "all_gates",
    "cache_live",
    "counters",
    "decode_region_hits",
    "drafter_live",
    "endpoints",
    "in_decode_region",
    "in_prefill_region",
    "logprobs",
    "reaches_decode_region",
    "trigger",
]


def endpoints(history: History) -> Finding:
    failed = history.failed()
    if not failed:
        return Finding.passed("endpoints", f"all {len(history.exchanges)} requests answered")
    by_arm = {arm: sum(1 for e in failed if e.arm == arm) for arm in sorted({e.arm for e in failed})}
    first = failed[0]
    return Finding.from_error(
        "endpoints",
        errors.EndpointError(
            f"{len(failed)} of {len(history.exchanges)} requests failed ({by_arm}); first: {first.case_id}: "
            f"{first.error}",
            hint="see exchanges.jsonl in the run folder and the server log",
        ),
        failed=by_arm,
    )


def logprobs(history: History) -> Finding:
    """Every answer that asked for logprobs carries finite ones: the graders compare logprobs, and an answer
    without them (a server or proxy that drops the field) or with NaN would otherwise read as identical."""
    asked = [e for e in history.exchanges if e.ok and e.request.get("logprobs") and (e.completion_tokens or e.text)]
    missing = [e.case_id for e in asked if not e.tokens]
    bad = [
        e.case_id
        for e in asked
        if any(not math.isfinite(t.logprob) or any(not math.isfinite(v) for _, v in t.top) for t in e.tokens)
    ]
    if not missing and not bad:
        return Finding.passed("logprobs", f"all {len(asked)} answers that asked for logprobs carry finite ones")
    problems = []
    if missing:
        problems.append(f"{len(missing)} answers came without logprobs (first: {missing[0]})")
    if bad:
        problems.append(f"{len(bad)} answers carry NaN or infinite logprobs (first: {bad[0]})")
    return Finding.from_error(
        "logprobs",
        errors.EndpointError(
            "; ".join(problems),
            hint="the server must honour `logprobs` and `top_logprobs` (check --max-logprobs, and any proxy in "
            "between); NaN logprobs are a server fault of their own (vLLM #34587)",
        ),
        missing=missing[:20],
        non_finite=bad[:20],
    )


def counters(history: History) -> Finding:
    try:
        for arm, delta in history.deltas.items():
            delta.check_monotonic(arm)
    except errors.CounterReset as exc:
        return Finding.from_error("counters", exc)
    return Finding.passed("counters", "no counter went backwards")


def cache_live(history: History) -> Finding:
    delta = history.deltas.get(Arm.TREATMENT)
    hits = delta.value(metrics.CACHE_HITS) if delta else None
    queries = delta.value(metrics.CACHE_QUERIES) if delta else None
    usage = sum(e.cached_tokens or 0 for e in history.exchanges if e.arm == Arm.TREATMENT)
    figures = {
        "hit_tokens": hits,
        "query_tokens": queries,
        "usage_cached_tokens": usage,
        "hit_ratio": (hits / queries) if hits is not None and queries else None,
    }
    if hits is None:
        return Finding.from_error(
            "cache-live",
            errors.CacheNotLive(
                f"the treatment's /metrics has no {metrics.CACHE_HITS}_total counter",
                hint="is prefix caching enabled on the treatment (--enable-prefix-caching)?",
            ),
            **figures,
        )
    if hits <= 0:
        # A cache too small for the requests in flight evicts every prefix before its follow-up comes (the load
        # probe at 70 GPU blocks: 0 hits, up to 78 preemptions), which no prefix-caching flag mends.
        assert delta is not None
        pressure = {"preemptions": delta.value(metrics.PREEMPTIONS), "evictions": delta.value(metrics.EVICTIONS)}
        said = [f"{name} {value:g}" for name, value in pressure.items() if value]
        hint = (
            "start the treatment with --enable-prefix-caching --mamba-cache-mode align; a known regression drops "
            "hybrid hit rates to 0% (vLLM #54360)"
        )
        if said:
            hint = (
                f"the treatment was under memory pressure over the run ({', '.join(said)}): its KV cache may be too "
                "small to keep a prefix until the follow-up comes. Give it more KV-cache blocks or send fewer "
                "conversations at once (--concurrency); if neither helps, " + hint
            )
        return Finding.from_error(
            "cache-live",
            errors.CacheNotLive(
                f"the treatment's prefix-cache hit counter did not move over {queries or 0:g} queried tokens",
                hint=hint,
            ),
            **figures,
            **pressure,
        )
    ratio = f"{hits / queries:.1%}" if queries else "n/a"
    return Finding.passed(
        "cache-live", f"{hits:g} tokens hit the cache (hit ratio {ratio}; usage says {usage})", **figures
    )


def all_gates(history: History, grading: Grading, probes: Sequence[str] = ("multiturn",)) -> list[Finding]:
    """The gates every probe shares, then each named probe's trigger proof."""
    found = [endpoints(history), logprobs(history), counters(history), cache_live(history)]
    for probe in selected(probes):
        found += probe.gates(history, grading)
    return found
