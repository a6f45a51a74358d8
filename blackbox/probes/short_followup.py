"""The short follow-up probe: after a decode-region hit, a follow-up of 1 token, of 2 tokens, and one shorter than a
block.

Every other probe's resume adds a question (the chat template alone adds about 8 tokens), so the prefill after its
hit always carries new text. A follow-up of 1-2 tokens is the case where a prefill is shorter than the drafter's
lookahead, which vLLM has mis-handled as a decode step in a mixed batch (the A6 family,
test_hybrid_chunked_prefill.py: lost facts). Here the request re-sends prefix A and its answer and continues the
answer itself (`continue_final_message`, no generation prompt), with 1 and 2 more tokens; then a third asks a short
question as a new user turn (shorter than a block). Each is sent again on a fresh cache_salt (recomputation), and the
reference runs the same (`probes/resumes.py`: prefixes laid out as the held-prefix probe's, on documents of their
own).

Trigger proof (`short-trigger`): for enough prefixes, a follow-up that added at most 2 tokens to A's whole sequence
(prompt tokens less A's prompt and answer, measured from usage) hit past A's prompt, in its decode-written blocks.

Grader (`short-follow-up`): the statistics every grader shares (`evidence.judge_samples`), one sample per prefix:
the largest deviation from recomputation over its follow-ups that hit there, against the same on the reference. The
follow-ups of one prefix resume from one set of blocks, so the prefix, not the follow-up, is the draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from blackbox import errors
from blackbox.config import Grading
from blackbox.evidence import Sample
from blackbox.history import Arm, Exchange, History, Plan
from blackbox.probes.base import DriveContext, Driven
from blackbox.probes.resumes import (
    Resume,
    ResumeProbe,
    Stage,
    body,
    drive_prefixes,
    grade_prefixes,
    no_usage,
    prefixes,
    resumed,
)
from blackbox.verdict import Finding
from blackbox.workload import turn2_messages

__all__ = ["FIRST", "KINDS", "SHORT", "SHORT_FOLLOW_UP", "ShortFollowUp", "extensions", "trigger"]

FIRST = 40_000  # conversation id of the first prefix (apart from the other probes' documents)
TURN1 = "short-a"
# Request kind -> (what it appends to A's answer, whether it continues the answer rather than asking anew).
FOLLOW_UPS: Mapping[str, tuple[str, bool]] = {
    "short-1": (" .", True),
    "short-2": (" . .", True),
    "short-q": ("ok .", False),
}
KINDS = tuple(FOLLOW_UPS)
SHORT = 2  # a follow-up adding at most this many tokens to A's sequence is the probe's trigger


def followups(conversations: int) -> int:
    """Prefixes a run holds: each costs 1 + 2 * 3 requests an arm, a multi-turn conversation about 4."""
    return max(4, conversations // 2)


class ShortFollowUp(ResumeProbe):
    name = "short-follow-up"
    about = "after a decode-region hit, follow-ups of 1 and 2 tokens and one shorter than a block"
    grader = "short-follow-up"

    async def drive(self, ctx: DriveContext) -> Driven:
        return await drive_prefixes(ctx, FIRST, followups(ctx.config.conversations), TURN1, _stages(ctx), "prefixes")


def _stages(ctx: DriveContext) -> Callable[[Plan, Exchange], list[Stage]]:
    """One follow-up at a time, so each resumes alone from A's blocks."""

    def stages(plan: Plan, a: Exchange) -> list[Stage]:
        out: list[Stage] = []
        for kind, (text, continues) in FOLLOW_UPS.items():
            if continues:
                messages = (*plan.turn1_messages, {"role": "assistant", "content": a.text + text})
                request = body(ctx, messages, continue_final_message=True, add_generation_prompt=False)
            else:
                request = body(ctx, (*turn2_messages(plan, a.text)[:-1], {"role": "user", "content": text}))
            out.append([(kind, request)])
        return out

    return stages


def extensions(history: History, arm: str, prefix: int) -> dict[str, int | None]:
    """Per follow-up, the tokens it added to A's whole sequence (its prompt less A's prompt and answer)."""
    a = history.get(prefix, arm, TURN1)
    if a is None or a.prompt_tokens is None or a.completion_tokens is None:
        return dict.fromkeys(KINDS)
    whole = a.prompt_tokens + a.completion_tokens
    out: dict[str, int | None] = {}
    for kind in KINDS:
        e = history.get(prefix, arm, kind)
        out[kind] = None if e is None or e.prompt_tokens is None else e.prompt_tokens - whole
    return out


def _hits(history: History, arm: str, hard_margin: float, tokens: int | None = None) -> dict[int, list[Resume]]:
    return {
        p: found
        for p, prompt in prefixes(history, ShortFollowUp.name, arm).items()
        if (found := resumed(history, arm, p, prompt, KINDS, hard_margin, tokens))
    }


def trigger(history: History, grading: Grading) -> Finding:
    held = prefixes(history, ShortFollowUp.name, Arm.TREATMENT)
    hits = _hits(history, Arm.TREATMENT, math.inf)
    grown = {p: extensions(history, Arm.TREATMENT, p) for p in held}
    short = {p for p, found in hits.items() if any(0 < (grown[p].get(r.kind) or 0) <= SHORT for r in found)}
    need = max(1, math.ceil(grading.min_trigger_fraction * len(held)))
    follow = {p: [history.get(p, Arm.TREATMENT, k) for k in KINDS] for p in held}
    figures: dict[str, Any] = {
        "prefixes": len(held),
        "short_hit_prefixes": len(short),
        "needed": need,
        "cached_tokens": {p: [e.cached_tokens if e else None for e in es] for p, es in follow.items()},
        "added_tokens": grown,
        "turn1_prompt_tokens": held,
    }
    if held and not any(e is not None and e.ok and e.cached_tokens is not None for es in follow.values() for e in es):
        return no_usage("short-trigger", figures)
    if len(short) < need:
        return Finding.from_error(
            "short-trigger",
            errors.TriggerNotExercised(
                f"only {len(short)} of {len(held)} prefixes had a follow-up of at most {SHORT} added tokens hit past "
                f"A's prompt, in its decode-written blocks (need {need})",
                hint="a server that cannot continue an assistant message (continue_final_message) adds more; keep "
                "decode-written checkpoints (--prefix-cache-retention-interval None on vLLM >= 0.29)",
            ),
            **figures,
        )
    return Finding.passed(
        "short-trigger",
        f"{len(short)} of {len(held)} prefixes had a follow-up of 1-{SHORT} tokens resume from their decode-written "
        "blocks",
        **figures,
    )


def _sample(prefix: int, found: Sequence[Resume]) -> Sample:
    worst = max(found, key=lambda r: r.deviation)
    return Sample(prefix, worst.kind, worst.deviation, any(r.differs for r in found))


def _samples(history: History, arm: str, hard_margin: float, tokens: int) -> list[Sample]:
    return [_sample(p, found) for p, found in _hits(history, arm, hard_margin, tokens).items()]


def grade(history: History, grading: Grading, alpha: float) -> Finding:
    what = "short follow-ups (each prefix its follow-ups' largest deviation)"
    return grade_prefixes(history, grading, alpha, ShortFollowUp.name, "short-follow-up", _samples, what)


SHORT_FOLLOW_UP = ShortFollowUp(trigger, grade)
