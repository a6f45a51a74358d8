"""The load probe: more conversations in flight than the KV cache holds, so requests are preempted and blocks
evicted and re-written while others resume from decode-written blocks.

The other probes keep a few requests in flight against a cache that holds them all, so no request is preempted and
no decode-written block is evicted before its follow-up comes. Under memory pressure vLLM preempts a running request,
frees its blocks and later reschedules it, looking up its own prompt and answer so far in the prefix cache, while
the blocks other requests freed are evicted and re-allocated; #53919's async-scheduling race corrupted cached
state only with several requests running (16/288 corrupt at max-num-seqs 4, 0/288 at 2).

Plans: `--conversations` prefixes (documents of their own), each turn 1 forced on past its prompt (decode-written
blocks), then a follow-up that re-sends it and asks a question, then that follow-up again on a fresh cache_salt
(`probes/resumes.py`), `--concurrency` chains at once, each follow-up sent the moment its turn 1 is answered.
Against a KV cache that holds fewer conversations than are in flight (`--profile cpu-tiny-load`:
`--num-gpu-blocks-override`), the server must preempt running requests and evict cached blocks, while follow-ups
look up blocks freed a moment before. (More in flight than the server runs at once does not add pressure but
takes it away: a follow-up then waits behind queued turn 1s, whose allocations evict its blocks before it is
looked up; measured on the CPU pair, 16 in flight against 8 running hit nothing.) The reference runs the same.

Trigger proof (`load-trigger`): over the probe the treatment preempted requests (`vllm:num_preemptions_total`) or
evicted cached blocks (`vllm:kv_block_idle_before_evict_seconds` count, with `--kv-cache-metrics`), and enough
follow-ups still hit past turn 1's prompt. It states whether the treatment scheduled asynchronously (the #53919
path): vLLM's CPU backend forces async scheduling off, so on the CPU pair this probe cannot reach that race.

Grader (`load`): the statistics every grader shares, one sample per prefix (its follow-up's deviation from
recomputation), against the reference's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from blackbox import errors, metrics
from blackbox.config import Grading
from blackbox.evidence import Sample
from blackbox.history import Arm, Exchange, History, Plan
from blackbox.metrics import MetricsDelta
from blackbox.probes.base import DriveContext, Driven, settle
from blackbox.probes.resumes import ResumeProbe, Stage, body, drive_prefixes, grade_prefixes, prefixes, resumed
from blackbox.verdict import Finding
from blackbox.workload import turn2_messages

__all__ = ["EVICTIONS", "FIRST", "LOAD", "PREEMPTIONS", "Load", "scheduling", "trigger"]

FIRST = 50_000  # conversation id of the first prefix (apart from the other probes' documents)
TURN1, FOLLOW = "load-a", "load-b"
PREEMPTIONS, EVICTIONS = metrics.PREEMPTIONS, metrics.EVICTIONS


class Load(ResumeProbe):
    name = "load"
    about = "more conversations in flight than the KV cache holds: preemption and eviction under resumes"
    launched_for = "it needs both arms served with a small KV cache: --profile cpu-tiny-load"
    grader = "load"

    async def drive(self, ctx: DriveContext) -> Driven:
        before = await settle(ctx.treatment, ctx.config.settle_s)
        driven = await drive_prefixes(ctx, FIRST, ctx.config.conversations, TURN1, _stages(ctx), "prefixes under load")
        window = MetricsDelta(before, await settle(ctx.treatment, ctx.config.settle_s))
        pressure = {"preemptions": window.value(PREEMPTIONS), "evictions": window.value(EVICTIONS)}
        return replace(driven, data={**(driven.data or {}), "window": pressure})


def _stages(ctx: DriveContext) -> Callable[[Plan, Exchange], list[Stage]]:
    def stages(plan: Plan, a: Exchange) -> list[Stage]:
        return [[(FOLLOW, body(ctx, turn2_messages(plan, a.text)))]]

    return stages


def _hits(history: History, arm: str, hard_margin: float, tokens: int | None = None) -> dict[int, Sample]:
    out = {}
    for p, prompt in prefixes(history, Load.name, arm).items():
        for r in resumed(history, arm, p, prompt, (FOLLOW,), hard_margin, tokens):
            out[p] = Sample(p, r.kind, r.deviation, r.differs)
    return out


def scheduling(history: History) -> str:
    info = history.treatment_info
    value = info.settings.get("async_scheduling") if info is not None else None
    if value is None:
        return "async scheduling not published by the treatment"
    on = value.lower() == "true"
    cpu = info is not None and ("cpu" in (info.version or "") or any(k.startswith("VLLM_CPU_") for k in info.settings))
    why = " (vLLM's CPU backend forces it off, so #53919's race is out of reach here)" if not on and cpu else ""
    return f"async scheduling {'on' if on else 'off'}{why}"


def trigger(history: History, grading: Grading) -> Finding:
    held = prefixes(history, Load.name, Arm.TREATMENT)
    window: Mapping[str, Any] = (history.extras.get(Load.name) or {}).get("window") or {}
    preempted, evicted = window.get("preemptions"), window.get("evictions")
    hit = _hits(history, Arm.TREATMENT, math.inf)
    need = max(1, math.ceil(grading.min_trigger_fraction * len(held)))
    mode = scheduling(history)
    figures: dict[str, Any] = {
        "prefixes": len(held),
        "decode_region_hits": len(hit),
        "needed": need,
        "preemptions": preempted,
        "evictions": evicted,
        "scheduling": mode,
    }
    if not preempted and not evicted:
        said = "evictions not published (start it with --kv-cache-metrics)" if evicted is None else "0 evictions"
        return Finding.from_error(
            "load-trigger",
            errors.TriggerNotExercised(
                f"the treatment preempted no request ({'0' if preempted is not None else 'not published'}) "
                f"and {said} during the load probe: its KV cache held the whole load",
                hint="serve the pair with a small KV cache (--profile cpu-tiny-load, or --num-gpu-blocks-override N "
                "on both arms) so the probe's conversations do not fit",
            ),
            **figures,
        )
    if len(hit) < need:
        return Finding.from_error(
            "load-trigger",
            errors.TriggerNotExercised(
                f"only {len(hit)} of {len(held)} follow-ups under load hit past turn 1's prompt (need {need}): the "
                "cache evicted their decode-written blocks before they came",
                hint="a larger --num-gpu-blocks-override, or fewer --conversations",
            ),
            **figures,
        )
    pressure = f"{int(preempted or 0)} preemptions, " + (
        f"{int(evicted)} evicted blocks" if evicted is not None else "evictions not published"
    )
    return Finding.passed(
        "load-trigger",
        f"{len(hit)} of {len(held)} follow-ups resumed from decode-written blocks under load ({pressure}; {mode})",
        **figures,
    )


def _samples(history: History, arm: str, hard_margin: float, tokens: int) -> list[Sample]:
    return list(_hits(history, arm, hard_margin, tokens).values())


def grade(history: History, grading: Grading, alpha: float) -> Finding:
    return grade_prefixes(history, grading, alpha, Load.name, "load", _samples, "follow-ups under load")


LOAD = Load(trigger, grade)
