"""Liveness gates: proof that the trigger fired, checked before any grader is believed.

A gate that fails turns the run UNKNOWN with its own class; a run that tested nothing is never PASS.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from blackbox import errors, metrics, race
from blackbox.config import Grading
from blackbox.history import Arm, History, Kind, Plan
from blackbox.server_info import trigger_hint
from blackbox.verdict import Finding

__all__ = ["all_gates", "decode_region_hits", "in_decode_region", "in_prefill_region", "reaches_decode_region"]


def in_prefill_region(plan: Plan, cached: int) -> bool:
    """A hit that ends inside turn 1's prompt resumes from a checkpoint written during prefill."""
    return 0 < cached <= plan.turn1_prompt_tokens


def in_decode_region(plan: Plan, cached: int) -> bool:
    """A hit that ends past turn 1's prompt resumes from a checkpoint written while turn 1 was decoding (the block
    the prompt ended in was completed by decode): the blocks speculative decoding wrote."""
    return cached > plan.turn1_prompt_tokens


def reaches_decode_region(history: History, conversation: int, arm: str) -> bool:
    plan = history.plan(conversation)
    turn2 = history.get(conversation, arm, Kind.TURN2)
    if plan is None or turn2 is None or not turn2.ok or turn2.cached_tokens is None:
        return False
    return in_decode_region(plan, turn2.cached_tokens)


def decode_region_hits(history: History, arm: str) -> list[int]:
    return [p.index for p in history.plans if reaches_decode_region(history, p.index, arm)]


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
        return Finding.from_error(
            "cache-live",
            errors.CacheNotLive(
                f"the treatment's prefix-cache hit counter did not move over {queries or 0:g} queried tokens",
                hint="start the treatment with --enable-prefix-caching --mamba-cache-mode align; a known regression "
                "drops hybrid hit rates to 0% (vLLM #54360)",
            ),
            **figures,
        )
    ratio = f"{hits / queries:.1%}" if queries else "n/a"
    return Finding.passed(
        "cache-live", f"{hits:g} tokens hit the cache (hit ratio {ratio}; usage says {usage})", **figures
    )


def trigger(history: History, grading: Grading) -> Finding:
    plans = history.plans
    turn2 = [history.get(p.index, Arm.TREATMENT, Kind.TURN2) for p in plans]
    reported = [e for e in turn2 if e is not None and e.ok and e.cached_tokens is not None]
    hits = decode_region_hits(history, Arm.TREATMENT)
    need = max(1, math.ceil(grading.min_trigger_fraction * len(plans)))
    figures = {
        "conversations": len(plans),
        "decode_region_hits": len(hits),
        "needed": need,
        "fraction": len(hits) / len(plans) if plans else 0.0,
        "cached_tokens": [e.cached_tokens if e else None for e in turn2],
        "turn1_prompt_tokens": [p.turn1_prompt_tokens for p in plans],
    }
    if plans and not reported:
        return Finding.from_error(
            "trigger",
            errors.TriggerNotExercised(
                "the treatment reported no usage.prompt_tokens_details.cached_tokens",
                hint="start the treatment with --enable-prompt-tokens-details",
            ),
            **figures,
        )
    if len(hits) < need:
        return Finding.from_error(
            "trigger",
            errors.TriggerNotExercised(
                f"only {len(hits)} of {len(plans)} turn-2 hits reached a block written during decode (need {need}); "
                "a hit must end past turn 1's prompt",
                hint=_known(history)
                + "keep decode-written checkpoints (--prefix-cache-retention-interval None on vLLM >= 0.29, "
                "VLLM_PREFIX_CACHE_RETENTION_INTERVAL unset before), "
                "check --block-size, or raise --answer-blocks",
            ),
            **figures,
        )
    return Finding.passed(
        "trigger", f"{len(hits)} of {len(plans)} turn-2 hits reached decode-written blocks", **figures
    )


def _known(history: History) -> str:
    """What the treatment's own release and settings explain, first in a hint."""
    said = trigger_hint(history.treatment_info) if history.treatment_info is not None else ""
    return f"{said}; otherwise: " if said else ""


def drafter_live(history: History) -> Finding:
    delta = history.deltas.get(Arm.TREATMENT)
    drafts = delta.value(metrics.DRAFTS) if delta else None
    drafted = delta.value(metrics.DRAFT_TOKENS) if delta else None
    accepted = delta.value(metrics.ACCEPTED) if delta else None
    per_pos = delta.per_label(metrics.ACCEPTED_PER_POS, "position") if delta else {}
    acceptance = {k: v / drafts for k, v in sorted(per_pos.items())} if drafts else {}
    figures = {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_per_position": acceptance,
    }
    if drafts is None:
        return Finding.from_error(
            "drafter-live",
            errors.SpecDecodeNotEngaged(
                "the treatment's /metrics has no speculative-decoding counters",
                hint="start the treatment with --speculative-config (MTP or EAGLE)",
            ),
            **figures,
        )
    if drafts <= 0 or not accepted:
        return Finding.from_error(
            "drafter-live",
            errors.SpecDecodeNotEngaged(
                f"the drafter proposed {drafts:g} drafts and {accepted or 0:g} tokens were accepted",
                hint="check the drafter loaded (server log) and that requests decode long enough",
            ),
            **figures,
        )
    rates = ", ".join(f"pos {k}: {v:.2f}" for k, v in acceptance.items())
    return Finding.passed("drafter-live", f"{drafts:g} drafts, {accepted:g} accepted tokens ({rates})", **figures)


def all_gates(history: History, grading: Grading, probes: Sequence[str] = ("multiturn",)) -> list[Finding]:
    found = [endpoints(history), logprobs(history), counters(history), cache_live(history)]
    if "multiturn" in probes:
        found += [trigger(history, grading), drafter_live(history)]
    if "cold-race" in probes:
        found += [
            race.fragmentation(history, history.races, history.race_window, history.step_budget),
            race.liveness(history),
        ]
    return found
