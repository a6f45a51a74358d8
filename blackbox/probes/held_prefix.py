"""The held-prefix probe (A->B->A): one cached prefix, written during decode, resumed from again and again.

A checkpoint that is wrong once is inherited by every request that resumes from it (the users' A->B->A probe,
vLLM #49127; the held-prefix protocol of club-3090 #710: hold one prefix, poison it, re-probe it). The multi-turn
probe resumes from each decode-written block once, so it cannot tell a poisoned block from a sound one restored
wrong, and it never resumes from one prefix with several requests in flight.

Plans (seeded by run seed and prefix index, documents as the multi-turn probe's): prefix A is turn 1 of a
conversation, its answer forced on for several blocks past its prompt, so the blocks past the prompt are written
while the drafter speculates. Then `RESUMES` other requests B1..Bn, sent together, each re-send A and its answer and
ask a different question (different continuations of one held prefix); then A's own follow-up, alone. Each of
these resumes is sent again with a fresh cache_salt (recomputation, no reuse possible). The reference (the
treatment's flags without speculative decoding) runs the same plans, and `--reference-ratio` times as many.

Trigger proof (`held-trigger`): for enough prefixes, at least two resumes hit past A's prompt (their cached_tokens
reach the decode-written region) at the same length: the same block was re-hit.

Grader (`held-prefix`): the statistics every grader shares (`evidence.judge_samples`), one sample per re-hit
block: the largest deviation from recomputation over that block's resumes, against the same on the reference. Its
resumes share one restored state, so they are not independent draws; the block is. A FAIL also says what it saw:
where every resume of a block deviated beyond the reference, the block behaves as poisoned (a wrong state stored,
or a restore that is wrong every time: from outside the two are one); where only some did, the fault is transient
(the block is sound, some restores of it are not).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from blackbox import errors
from blackbox.config import Grading
from blackbox.evidence import Sample, judge_samples
from blackbox.history import Arm, Exchange, History, Plan
from blackbox.probes.base import (
    DriveContext,
    Driven,
    compared_positions,
    not_used,
    with_positions,
)
from blackbox.probes.resumes import ResumeProbe, Stage, body, drive_prefixes, no_usage, prefixes, resumed
from blackbox.verdict import Finding
from blackbox.vocabulary import NAMES
from blackbox.workload import question_for, turn2_messages

__all__ = [
    "FIRST",
    "HELD_PREFIX",
    "RESUMES",
    "HeldPrefix",
    "blocks",
    "held_prefixes",
    "in_flight_together",
    "shape_of",
    "trigger",
]

FIRST = 20_000  # conversation id of the first held prefix (apart from the other probes' documents)
RESUMES = 3  # other requests B1..Bn per prefix; A's own follow-up is one more resume
TURN1 = "held-a"
FOLLOW = "held-a2"  # A's own follow-up, after the others


def resume_kinds(resumes: int = RESUMES) -> tuple[str, ...]:
    return (*(f"held-b{j}" for j in range(resumes)), FOLLOW)


def held_prefixes(conversations: int) -> int:
    """How many prefixes a run holds: each costs 2 + 2 * (RESUMES + 1) requests on each arm, about twice what a
    multi-turn conversation does, so half as many as --conversations (at least 4)."""
    return max(4, conversations // 2)


@dataclass(frozen=True)
class Block:
    """One re-hit block: a prefix and the cached length its resumes reached, with each resume's deviation."""

    prefix: int
    cached: int
    deviations: tuple[tuple[str, float, bool], ...]  # (request kind, deviation, not bit-identical)


class HeldPrefix(ResumeProbe):
    name = "held-prefix"
    about = "one decode-written prefix resumed by several requests, then by its own follow-up (A->B->A)"
    grader = "held-prefix"

    async def drive(self, ctx: DriveContext) -> Driven:
        driven = await drive_prefixes(ctx, FIRST, held_prefixes(ctx.config.conversations), TURN1, _stages(ctx))
        return replace(driven, data={**(driven.data or {}), "resumes": RESUMES})


def _stages(ctx: DriveContext) -> Callable[[Plan, Exchange], list[Stage]]:
    """B1..Bn together, then A's follow-up alone."""

    def stages(plan: Plan, a: Exchange) -> list[Stage]:
        rng = random.Random(f"blackbox-held:{ctx.config.seed}:{plan.index}")
        others = [question_for(name) for name in rng.sample(NAMES, RESUMES)]
        held = turn2_messages(plan, a.text)[:-1]  # A and its answer: the prefix every resume re-sends
        b = [(f"held-b{j}", body(ctx, (*held, {"role": "user", "content": q}))) for j, q in enumerate(others)]
        return [b, [(FOLLOW, body(ctx, turn2_messages(plan, a.text)))]]

    return stages


def _prefixes(history: History, arm: str) -> dict[int, int]:
    return prefixes(history, HeldPrefix.name, arm)


def _resumes(history: History) -> tuple[str, ...]:
    data = history.extras.get(HeldPrefix.name) or {}
    return resume_kinds(int(data.get("resumes", RESUMES)))


def blocks(history: History, arm: str, hard_margin: float, tokens: int | None = None) -> list[Block]:
    """Each block of `arm` that resumes re-hit in A's decode-written region, with every such resume's deviation
    from its recomputation over the first `tokens` answer positions. Answers without logprobs are left out."""
    out: list[Block] = []
    for prefix, prompt in _prefixes(history, arm).items():
        by_length: dict[int, list[tuple[str, float, bool]]] = defaultdict(list)
        for r in resumed(history, arm, prefix, prompt, _resumes(history), hard_margin, tokens):
            by_length[r.cached].append((r.kind, r.deviation, r.differs))
        out += [Block(prefix, cached, tuple(devs)) for cached, devs in sorted(by_length.items()) if len(devs) >= 2]
    return out


def in_flight_together(exchanges: Sequence[Exchange | None]) -> bool | None:
    """Whether two of these requests were in flight at once, as the client timed them (None where a request has no
    start time: run folders from before the timeline). The client's clock, not the server's: overlap here is what
    lets two resumes share a scheduler step, not proof that they did."""
    sent = [e for e in exchanges if e is not None and e.ok]
    if any(e.started_s is None for e in sent):
        return None
    spans = sorted((e.started_s, e.started_s + e.elapsed_s) for e in sent if e.started_s is not None)
    # Sorted by start, some two overlap exactly where some neighbours do.
    return any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))


def _together(history: History, blocks_hit: Sequence[Block]) -> int | None:
    """How many re-hit blocks two or more of their resumes were sent to at once (None: the run has no timeline)."""
    found = [
        in_flight_together([history.get(b.prefix, Arm.TREATMENT, kind) for kind, _, _ in b.deviations])
        for b in blocks_hit
    ]
    return None if any(f is None for f in found) else sum(bool(f) for f in found)


def trigger(history: History, grading: Grading) -> Finding:
    prefixes = _prefixes(history, Arm.TREATMENT)
    resumes = [history.get(p, Arm.TREATMENT, k) for p in prefixes for k in _resumes(history)]
    reported = [e for e in resumes if e is not None and e.ok and e.cached_tokens is not None]
    hit = blocks(history, Arm.TREATMENT, math.inf)
    held = {b.prefix for b in hit}
    together = _together(history, hit)
    need = max(1, math.ceil(grading.min_trigger_fraction * len(prefixes)))
    figures: dict[str, Any] = {
        "prefixes": len(prefixes),
        "re_hit_prefixes": len(held),
        "re_hit_together": together,
        "needed": need,
        "cached_tokens": {
            p: [e.cached_tokens if e else None for e in (history.get(p, Arm.TREATMENT, k) for k in _resumes(history))]
            for p in prefixes
        },
        "turn1_prompt_tokens": prefixes,
    }
    if prefixes and not reported:
        return no_usage("held-trigger", figures)
    if len(held) < need:
        return Finding.from_error(
            "held-trigger",
            errors.TriggerNotExercised(
                f"only {len(held)} of {len(prefixes)} held prefixes had two or more resumes hit one block written "
                f"during decode (need {need}); a hit must end past A's prompt",
                hint="keep decode-written checkpoints (--prefix-cache-retention-interval None on vLLM >= 0.29), "
                "check --block-size, or raise --answer-blocks",
            ),
            **figures,
        )
    # Not a gate: a block re-hit one resume at a time still tests a poisoned checkpoint, but not the resumes that
    # share a step (the concurrent-resume family), so the reason says how many blocks the probe reached that way.
    at_once = "" if together is None else f", {together} of {len(hit)} blocks by two or more resumes in flight at once"
    return Finding.passed(
        "held-trigger",
        f"{len(held)} of {len(prefixes)} held prefixes were re-hit in their decode-written blocks{at_once}",
        **figures,
    )


def _sample(block: Block) -> Sample:
    worst = max(block.deviations, key=lambda d: d[1])
    return Sample(block.prefix, worst[0], worst[1], any(d[2] for d in block.deviations))


def shape_of(subject: Sequence[Block], yardstick: Sequence[Block]) -> dict[str, Any]:
    """Per treatment block, how many of its resumes deviated beyond anything the reference's blocks showed (any
    difference where the reference is exact): all of them reads as a poisoned block, some as a transient fault."""
    exact = not any(d[2] for b in yardstick for d in b.deviations)
    largest = max((d[1] for b in yardstick for d in b.deviations), default=0.0)

    def deviates(d: tuple[str, float, bool]) -> bool:
        return d[2] if exact else d[1] > largest or d[1] == math.inf

    counts = {f"{b.prefix}@{b.cached}": (sum(map(deviates, b.deviations)), len(b.deviations)) for b in subject}
    poisoned = sorted(k for k, (bad, n) in counts.items() if bad == n)
    transient = sorted(k for k, (bad, n) in counts.items() if 0 < bad < n)
    seen = "poisoned" if poisoned and not transient else "transient" if transient and not poisoned else None
    if poisoned and transient:
        seen = "both"
    return {
        "deviating_resumes": {k: f"{bad}/{n}" for k, (bad, n) in counts.items()},
        "poisoned_blocks": poisoned,
        "transient_blocks": transient,
        "seen": seen,
    }


def _said(shape: Mapping[str, Any]) -> str:
    poisoned, transient = len(shape["poisoned_blocks"]), len(shape["transient_blocks"])
    parts = []
    if poisoned:
        parts.append(f"every resume of {poisoned} block(s) deviated: a poisoned block")
    if transient:
        parts.append(f"only some resumes of {transient} block(s) deviated: a transient fault")
    return "; ".join(parts)


def grade(history: History, grading: Grading, alpha: float) -> Finding:
    if Arm.REFERENCE not in history.arms():
        return not_used(
            "held-prefix",
            "needs a reference server (the treatment's flags without speculative decoding): without one this run "
            "cannot measure how far a correct engine's re-hit blocks deviate from recomputation",
        )
    n = compared_positions(history, grading)
    t = blocks(history, Arm.TREATMENT, grading.hard_margin, n)
    r = blocks(history, Arm.REFERENCE, grading.hard_margin, n)
    if not t or not r:
        return not_used(
            "held-prefix", f"no re-hit decode-region blocks to compare (treatment {len(t)}, reference {len(r)})"
        )
    worst = sorted(t, key=lambda b: -_sample(b).deviation)[:5]
    finding = judge_samples(
        "held-prefix",
        [_sample(b) for b in t],
        [_sample(b) for b in r],
        alpha=alpha,
        what="treatment held-prefix blocks (each its resumes' largest deviation)",
        against="the reference's",
        assumed=grading.yardstick_assumed,
        runs=len(_prefixes(history, Arm.TREATMENT)),
        hint=f"replay held prefixes {[b.prefix for b in worst]} (the largest deviations) from the run folder's replay/",
        run_unit="held prefixes",
    )
    shape = shape_of(t, r)
    if finding.error_class == "CorruptionDetected" and (said := _said(shape)):
        finding = replace(finding, reason=f"{finding.reason}; {said}")
    return with_positions(n, replace(finding, figures={**finding.figures, **shape}))


HELD_PREFIX = HeldPrefix(trigger, grade)
