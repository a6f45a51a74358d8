"""What the probes that resume from one decode-written prefix share (held-prefix, short-follow-up).

A prefix A is turn 1 of a seeded conversation, its answer forced on past its prompt so the blocks there are written
while the drafter speculates. Then stages of resumes, each stage's requests sent together, each resume re-sending A
and its answer (then something of its own); then every resume again on a fresh cache_salt (recomputation, no reuse
possible). The reference runs the same prefixes, and `--reference-ratio` times as many. What the probe recorded of
its prefixes is `History.extras[probe]`: {"held": [...], "yardstick": [...]}, each row {"index", "prompt_tokens"}.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from blackbox import errors
from blackbox.client import gather_bounded
from blackbox.compare import deviation
from blackbox.config import Grading, RunConfig
from blackbox.evidence import Sample, judge_samples
from blackbox.history import Arm, Exchange, History, Plan
from blackbox.probes.base import (
    DriveContext,
    Driven,
    Grader,
    GraderFunction,
    Probe,
    compared_positions,
    not_used,
    with_positions,
)
from blackbox.verdict import Finding
from blackbox.workload import Messages, Shape, plan_conversation, turn1_body, turn2_body

__all__ = [
    "ANSWER_TOKENS",
    "Resume",
    "ResumeProbe",
    "Stage",
    "body",
    "drive_prefixes",
    "fresh",
    "grade_prefixes",
    "no_usage",
    "prefixes",
    "resumed",
]

ANSWER_TOKENS = 8  # of each resume: more than the positions compared (2 + speculative tokens)

Stage = Sequence[tuple[str, Mapping[str, object]]]  # (request kind, body without cache_salt), sent together
Stages = Callable[[Plan, Exchange], Sequence[Stage]]  # A's plan and answer -> the resumes to send


def fresh(kind: str) -> str:
    return f"{kind}-fresh"


class ResumeProbe(Probe):
    """A probe of resumes from held prefixes: one trigger gate and one grader, which it requires (its only one:
    without evidence the run is UNKNOWN rather than passing on another probe's)."""

    grader: ClassVar[str]

    def __init__(self, trigger: Callable[[History, Grading], Finding], grade: GraderFunction) -> None:
        self._trigger, self._grade = trigger, grade

    def gates(self, history: History, grading: Grading) -> list[Finding]:
        return [self._trigger(history, grading)]

    def graders(self, grading: Grading) -> list[Grader]:
        return [Grader(self.grader, self._grade, covers_trigger=True)]

    def required(self, grading: Grading) -> frozenset[str]:
        return frozenset({self.grader})


def no_usage(check: str, figures: Mapping[str, Any]) -> Finding:
    """The trigger finding for a treatment whose answers carried no cached_tokens: no hit can be shown."""
    return Finding.from_error(
        check,
        errors.TriggerNotExercised(
            "the treatment reported no usage.prompt_tokens_details.cached_tokens",
            hint="start the treatment with --enable-prompt-tokens-details",
        ),
        **figures,
    )


def _shape(config: RunConfig) -> Shape:
    """The multi-turn probe's layout with one resume: `--resumes` shapes the multi-turn probe alone."""
    return replace(config.shape, resumes=1)


def body(ctx: DriveContext, messages: Messages, **extra: object) -> dict[str, object]:
    """A resume's request: greedy with logprobs, `ANSWER_TOKENS` long (or the positions --compare-tokens asks)."""
    tokens = max(ANSWER_TOKENS, ctx.config.grading.compare_tokens or 0)
    return {**turn2_body(messages, _shape(ctx.config)), "max_tokens": tokens, **extra}


@dataclass(frozen=True)
class Resume:
    """One resume that hit past A's prompt: its kind, how far its hit reached, and its deviation from recomputation
    over the compared positions (and whether it differed at all)."""

    kind: str
    cached: int
    deviation: float
    differs: bool


async def drive_prefixes(
    ctx: DriveContext,
    first: int,
    held: int,
    turn1_kind: str,
    stages: Stages,
    unit: str = "held prefixes",
    in_flight: int | None = None,
    per_arm: bool = False,
) -> Driven:
    """Hold `held` prefixes on the treatment (and the reference), `reference_ratio` times as many on the
    reference alone; conversation ids from `first`; `in_flight` chains at once (default --concurrency), a prefix's
    chains on both arms together, or with `per_arm` `in_flight` on each arm whatever the other's pace (so the
    slower arm does not hold the faster one's slots: a load each server feels alike)."""
    config = ctx.config
    reference = Arm.REFERENCE in ctx.endpoints
    total = held * (config.reference_ratio if reference else 1)
    ctx.progress(0, total, unit)
    geo = ctx.geometry
    count = ctx.treatment.count_tokens
    plans: list[Plan] = await gather_bounded(
        config.concurrency * 2,
        *(
            plan_conversation(first + i, config.seed, _shape(config), geo.block_size, geo.max_model_len, count)
            for i in range(total)
        ),
    )

    async def one(plan: Plan) -> list[Exchange]:
        arms = [Arm.REFERENCE] if plan.index - first >= held else [Arm.TREATMENT, *([Arm.REFERENCE] * reference)]
        chains = await asyncio.gather(*(_chain(ctx, arm, plan, turn1_kind, stages) for arm in arms))
        return [e for chain in chains for e in chain]

    order = sorted(plans, key=lambda p: ((p.index - first) % held, p.index))
    if per_arm:
        arms = [Arm.TREATMENT, *([Arm.REFERENCE] * reference)]
        mine = {arm: [p for p in order if arm == Arm.REFERENCE or p.index - first < held] for arm in arms}
        runs = await asyncio.gather(
            *(
                gather_bounded(in_flight or config.concurrency, *(_chain(ctx, arm, p, turn1_kind, stages) for p in ps))
                for arm, ps in mine.items()
            )
        )
        found = [chain for run in runs for chain in run]
    else:
        found = await gather_bounded(in_flight or config.concurrency, *(one(p) for p in order))
    summary = [{"index": p.index, "prompt_tokens": p.turn1_prompt_tokens} for p in plans]
    return Driven(
        exchanges=tuple(e for chain in found for e in chain), data={"held": summary[:held], "yardstick": summary[held:]}
    )


async def _chain(ctx: DriveContext, arm: str, plan: Plan, turn1_kind: str, stages: Stages) -> list[Exchange]:
    """A, then each stage's resumes together, one stage after another; then each resume's recomputation."""
    salt, conv = ctx.salt, plan.index
    endpoint = ctx.endpoints[arm]

    async def ask(kind: str, body: Mapping[str, object], cache_salt: str) -> Exchange:
        return ctx.record(await endpoint.chat({**body, "cache_salt": cache_salt}, conversation=conv, kind=kind))

    a = await ask(turn1_kind, turn1_body(plan, _shape(ctx.config)), salt)
    if not a.ok:
        return [a]
    sent = [a]
    planned = stages(plan, a)
    for stage in planned:
        sent += await asyncio.gather(*(ask(kind, body, salt) for kind, body in stage))
    for kind, body in (r for stage in planned for r in stage):
        sent.append(await ask(fresh(kind), body, f"{salt}-{conv}-{kind}-fresh"))
    return sent


def prefixes(history: History, probe: str, arm: str) -> dict[int, int]:
    """Prefix index -> A's turn-1 prompt tokens, for the prefixes `arm` held in `probe`."""
    data: Mapping[str, Any] = history.extras.get(probe) or {}
    rows = list(data.get("held", ())) + (list(data.get("yardstick", ())) if arm == Arm.REFERENCE else [])
    return {int(r["index"]): int(r["prompt_tokens"]) for r in rows}


def resumed(
    history: History,
    arm: str,
    prefix: int,
    prompt: int,
    kinds: Sequence[str],
    hard_margin: float,
    tokens: int | None = None,
) -> list[Resume]:
    """The resumes of `kinds` on `prefix` whose hit ended past A's prompt (in its decode-written region), each
    against its recomputation over the first `tokens` answer positions. Answers without logprobs are left out."""
    out = []
    for kind in kinds:
        e, again = history.get(prefix, arm, kind), history.get(prefix, arm, fresh(kind))
        if e is None or again is None or not (e.ok and again.ok and e.tokens and again.tokens):
            continue
        if (e.cached_tokens or 0) > prompt:
            mine, theirs = e.tokens[:tokens], again.tokens[:tokens]
            out.append(Resume(kind, e.cached_tokens or 0, deviation(mine, theirs, hard_margin), mine != theirs))
    return out


Samples = Callable[[History, str, float, int], list[Sample]]  # (history, arm, hard margin, positions) -> a prefix each


def grade_prefixes(
    history: History,
    grading: Grading,
    alpha: float,
    probe: str,
    grader: str,
    samples: Samples,
    what: str,
    *,
    whole: bool = False,
) -> Finding:
    """The statistics every grader shares, one sample per prefix, the treatment's against the reference's.
    `whole`: the samples compare whole answers, not the first positions (`compared_positions`)."""
    if Arm.REFERENCE not in history.arms():
        return not_used(
            grader,
            "needs a reference server (the treatment's flags without speculative decoding): without one this run "
            f"cannot measure how far a correct engine's {what} deviate from recomputation",
        )
    n = compared_positions(history, grading)
    t, r = (
        samples(history, Arm.TREATMENT, grading.hard_margin, n),
        samples(history, Arm.REFERENCE, grading.hard_margin, n),
    )
    if not t or not r:
        return not_used(grader, f"no decode-region {what} to compare (treatment {len(t)}, reference {len(r)})")
    worst = sorted(t, key=lambda s: -s.deviation)[:5]
    finding = judge_samples(
        grader,
        t,
        r,
        alpha=alpha,
        what=f"treatment {what}",
        against="the reference's",
        assumed=grading.yardstick_assumed,
        runs=len(prefixes(history, probe, Arm.TREATMENT)),
        hint=f"replay prefixes {[s.unit for s in worst]} (the largest deviations) from the run folder's replay/",
        run_unit="prefixes",
    )
    if whole:
        return replace(finding, figures={**finding.figures, "compared_positions": "whole answer"})
    return with_positions(n, finding)
