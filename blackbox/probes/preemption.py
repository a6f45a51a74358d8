"""The preemption probe: turn 1s written while the server preempts them, each graded over its whole answer against
the same request answered again alone.

Under memory pressure vLLM preempts a running request, frees its blocks and later reschedules it, looking up its
prompt and its answer so far in the prefix cache and resuming from what it finds (#53919's path: the corruption
there appeared only with several requests running). That resume is not a new request: its hit is in no `usage`
(vLLM 0.32 records a request's prefill statistics only on its first admission) and no Prometheus metric counts it
(`PrefixCacheStats.preempted_hits` is not exported). So this probe cannot show which answers resumed, only that the
server preempted while they were written; it grades every answer, and a resume from a wrong state shows from the
position it resumed at onward.

Plans: `--conversations` prefixes (documents of their own), each turn 1 forced on past its prompt, `--concurrency`
on each arm, against servers whose KV cache holds fewer of them (`--profile cpu-tiny-preempt`). Then each answer is
asked for again on a fresh cache_salt, `RECOMPUTE_IN_FLIGHT` at a time, which the cache holds without preempting:
the recomputation; and at once a question that re-sends the recomputed answer on that salt (not graded: its hit
shows the cache live, without which no preempted request could resume from it, and the shared `cache-live` gate
reads it; under the pressure itself no follow-up hit, 0 of 16). The reference runs the same, `--reference-ratio`
times as many.

Trigger proof (`preempt-trigger`): the treatment preempted requests while the turn 1s ran, and so did the reference
(its yardstick must carry what a correct engine's preemption does to an answer), and neither preempted a
recomputation. It states whether the treatment scheduled asynchronously.

Grader (`preemption`): the statistics every grader shares, one sample per prefix: its turn 1's deviation from the
recomputation over the whole answer, against the reference's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from blackbox import errors, metrics
from blackbox.client import gather_bounded
from blackbox.compare import deviation
from blackbox.config import Grading
from blackbox.evidence import Sample
from blackbox.history import Arm, Exchange, History
from blackbox.metrics import MetricsDelta
from blackbox.probes.base import DriveContext, Driven, settle
from blackbox.probes.load import scheduling
from blackbox.probes.resumes import ResumeProbe, body, drive_prefixes, fresh, grade_prefixes, prefixes
from blackbox.verdict import Finding

__all__ = ["FIRST", "PREEMPTION", "RECOMPUTE_IN_FLIGHT", "Preemption", "trigger"]

FIRST = 60_000  # conversation id of the first prefix (apart from the other probes' documents)
TURN1, FOLLOW = "preempt-a", "preempt-b"
ASK = "What was that about?"  # the follow-up that shows the cache live
AGAIN = fresh(TURN1)
# Recomputations at once per arm: a turn 1 of the CPU presets takes about a fifth of cpu-tiny-preempt's cache.
RECOMPUTE_IN_FLIGHT = 2
ARMS = (Arm.TREATMENT, Arm.REFERENCE)


class Preemption(ResumeProbe):
    name = "preemption"
    about = "turn 1s the server preempts while writing them, each against the same answer recomputed alone"
    launched_for = "it needs both arms served with a KV cache too small for its turn 1s: --profile cpu-tiny-preempt"
    grader = "preemption"

    async def drive(self, ctx: DriveContext) -> Driven:
        arms = {a: ctx.endpoints[a] for a in ARMS if a in ctx.endpoints}
        limit = ctx.config.settle_s
        before = await asyncio.gather(*(settle(e, limit) for e in arms.values()))

        # Each arm its own --concurrency turn 1s: coupled by prefix, the treatment (faster, speculating) waited on
        # the reference and was hardly preempted (0-5 times at 100 blocks, the reference never).
        driven = await drive_prefixes(
            ctx, FIRST, ctx.config.conversations, TURN1, lambda _p, _a: (), "turn 1s", per_arm=True
        )
        middle = await asyncio.gather(*(settle(e, limit) for e in arms.values()))
        again = await asyncio.gather(*(_recompute(ctx, arm, driven.exchanges) for arm in arms))
        after = await asyncio.gather(*(settle(e, limit) for e in arms.values()))
        windows = {
            arm: {
                "preemptions": MetricsDelta(b, m).value(metrics.PREEMPTIONS),
                "recompute_preemptions": MetricsDelta(m, a).value(metrics.PREEMPTIONS),
            }
            for arm, b, m, a in zip(arms, before, middle, after, strict=True)
        }
        return Driven(
            exchanges=(*driven.exchanges, *(e for sent in again for e in sent)),
            data={**(driven.data or {}), "windows": windows},
        )


async def _recompute(ctx: DriveContext, arm: str, sent: Sequence[Exchange]) -> list[Exchange]:
    """Each answered turn 1 of `arm` asked again on a fresh cache_salt, a few at a time (none preempted)."""
    endpoint = ctx.endpoints[arm]

    async def again(a: Exchange) -> list[Exchange]:
        salt = f"{ctx.salt}-{a.conversation}-{AGAIN}"
        request = {k: v for k, v in a.request.items() if k != "model"}
        b = ctx.record(await endpoint.chat({**request, "cache_salt": salt}, conversation=a.conversation, kind=AGAIN))
        if not b.ok:
            return [b]
        messages = (*request["messages"], {"role": "assistant", "content": b.text}, {"role": "user", "content": ASK})
        follow = {**body(ctx, messages), "cache_salt": salt}
        return [b, ctx.record(await endpoint.chat(follow, conversation=a.conversation, kind=FOLLOW))]

    mine = [a for a in sent if a.arm == arm and a.kind == TURN1 and a.ok]
    return [e for pair in await gather_bounded(RECOMPUTE_IN_FLIGHT, *(again(a) for a in mine)) for e in pair]


def _windows(history: History) -> Mapping[str, Mapping[str, Any]]:
    return (history.extras.get(Preemption.name) or {}).get("windows") or {}


def trigger(history: History, grading: Grading) -> Finding:
    held = prefixes(history, Preemption.name, Arm.TREATMENT)
    windows = _windows(history)
    treated, ref = windows.get(Arm.TREATMENT) or {}, windows.get(Arm.REFERENCE)
    figures: dict[str, Any] = {
        "prefixes": len(held),
        "preemptions": treated.get("preemptions"),
        "reference_preemptions": None if ref is None else ref.get("preemptions"),
        "recompute_preemptions": {arm: w.get("recompute_preemptions") for arm, w in windows.items()},
        "scheduling": scheduling(history),
        "follow_up_hits": sum(
            bool((e := history.get(p, Arm.TREATMENT, FOLLOW)) and e.cached_tokens) for p in held
        ),  # what shows the cache live (after the pressure, on the recomputations' salts)
    }

    def unknown(message: str, hint: str) -> Finding:
        return Finding.from_error("preempt-trigger", errors.TriggerNotExercised(message, hint=hint), **figures)

    if not treated.get("preemptions"):
        said = "not published" if treated.get("preemptions") is None else "0"
        return unknown(
            f"the treatment preempted no request ({said}) while the {len(held)} turn 1s ran: its KV cache held them",
            "serve both arms with a KV cache too small for --concurrency turn 1s (--profile cpu-tiny-preempt, or "
            "--num-gpu-blocks-override N on both)",
        )
    if ref is not None and not ref.get("preemptions"):
        return unknown(
            "the reference preempted no request while its turn 1s ran, so its answers cannot show what a correct "
            "engine's preemption does to an answer",
            "serve the reference with the treatment's small KV cache (--num-gpu-blocks-override)",
        )
    redone = {arm: n for arm, n in figures["recompute_preemptions"].items() if n}
    if redone:
        return unknown(
            f"the recomputations were preempted themselves ({redone}): they are not a clean answer to compare with",
            f"a KV cache that holds {RECOMPUTE_IN_FLIGHT} turn 1s at once",
        )
    return Finding.passed(
        "preempt-trigger",
        f"the treatment preempted {int(treated['preemptions'])} times while its {len(held)} turn 1s ran"
        + ("" if ref is None else f" (the reference {int(ref['preemptions'])} times)")
        + f"; which answers resumed from cached blocks cannot be seen over HTTP, so every one is graded; "
        f"{figures['scheduling']}",
        **figures,
    )


def _samples(history: History, arm: str, hard_margin: float, _positions: int) -> list[Sample]:
    """A prefix each: its turn 1 against its recomputation, over the whole answer (a preempted request resumes at
    a position nobody can see from outside)."""
    out = []
    for p in prefixes(history, Preemption.name, arm):
        a, again = history.get(p, arm, TURN1), history.get(p, arm, AGAIN)
        if a is None or again is None or not (a.ok and again.ok and a.tokens and again.tokens):
            continue
        out.append(Sample(p, TURN1, deviation(a.tokens, again.tokens, hard_margin), a.tokens != again.tokens))
    return out


def grade(history: History, grading: Grading, alpha: float) -> Finding:
    return grade_prefixes(
        history, grading, alpha, Preemption.name, "preemption", _samples, "turn 1s under preemption", whole=True
    )


PREEMPTION = Preemption(trigger, grade)
