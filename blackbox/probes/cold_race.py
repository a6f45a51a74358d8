"""The cold-race probe: the write side of the cache (mechanism A1, vLLM #45477).

K identical cold prompts of 1-3 blocks go to the treatment at once, so their prefills share a small step budget
and are cut into chunks that end mid-block; a chunk-end state stored as a block's boundary snapshot is then
cached under the boundary's hash. Each racer decodes through the block its prompt ends in, so decode completes
that block and it is cached too. Follow-ups (the prompt, a racer's answer or a short one, and a block-long new
question) then resume from the boundaries the race wrote, and each is also sent on a fresh salt (recomputation).
Under MTP the lookup drops the last matched block: a follow-up with a short answer resumes a block below the
prompt's end (nothing, for a prompt under two blocks), one that re-sends the answer a block further.

Grading. A correct engine is not bit-exact here: recomputation chunks the prefill differently from the race,
which moves logprobs slightly (measured on the CPU pair: |Δ| over the top-5 up to 0.5, no confident token
flips). The noise is measured inside the same run: racers that hit nothing were computed cold under the race's
chunking, so their deviation from recomputation is the legitimate chunking noise, one draw a round (the racers of
a round share its one recomputation). Follow-ups that resumed from a
race-written boundary must not deviate more. A deviation compares whole next-token distributions (every token
both sides list in their top-k) up to and including the first differing token, since a wrong state moves the
runners-up and flips near-ties as readily as it moves the chosen token. Where every cold racer is bit-identical
to recomputation the engine is exact for this geometry, and any follow-up difference is evidence on its own.

Trigger proof: a round computed more prompt tokens than the largest engine step in the server's
`vllm:iteration_tokens_total` histogram over the race (or than a stated `--max-num-batched-tokens`), so prefills
really were split; follow-ups resumed from blocks such rounds wrote; and a prompt of 3+ blocks sent twice hits.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

from blackbox import errors
from blackbox.client import Endpoint
from blackbox.compare import deviation
from blackbox.config import Grading, RaceSettings
from blackbox.evidence import Sample, judge_samples
from blackbox.history import Arm, Exchange, History, RaceRound
from blackbox.metrics import MetricsDelta
from blackbox.probes.base import DriveContext, Driven, Grader, Probe, Record, compared_positions, settle, with_positions
from blackbox.verdict import Finding
from blackbox.vocabulary import FILLER, NAMES
from blackbox.workload import Shape, plan_conversation, question_for

__all__ = [
    "COLD_RACE",
    "ColdRace",
    "RaceRound",
    "RaceSettings",
    "deviation",
    "drive",
    "fragmentation",
    "largest_step",
    "liveness",
    "race_divergence",
    "racer_tokens",
    "resends_answer",
    "send_liveness",
]

LIVENESS = 10_000  # conversation id of the liveness pair
FIRST_ROUND = 1_000  # conversation ids of race rounds start here


def _body(messages: Sequence[Mapping[str, str]], settings: RaceSettings, salt: str) -> dict[str, object]:
    return {
        "messages": list(messages),
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": settings.top_logprobs,
        "max_tokens": settings.max_tokens,
        "cache_salt": salt,
    }


def racer_tokens(prompt_tokens: int, block_size: int) -> int:
    """What each racer decodes: through the block its prompt ends in and a quarter block on, so that block is
    completed (and cached) by decode and a follow-up that re-sends the answer matches it."""
    return -(-prompt_tokens // block_size) * block_size + block_size // 4 - prompt_tokens


def resends_answer(followup: int, prompt_tokens: int, block_size: int) -> bool:
    """Whether follow-up `followup` re-sends a racer's answer (reaching the boundary the prompt ended past) or a
    short one (resuming inside the prompt's own blocks). Under MTP the lookup drops the last matched block, so
    below two prompt blocks only the first kind can hit; above, they alternate and both boundaries are tested."""
    return followup % 2 == 1 or prompt_tokens < 2 * block_size


async def drive(
    treatment: Endpoint,
    settings: RaceSettings,
    seed: int,
    block_size: int,
    max_model_len: int,
    salt: str,
    record: Record,
) -> list[RaceRound]:
    rounds: list[RaceRound] = []
    index = FIRST_ROUND
    for blocks in settings.sizes:
        margin = round((1 - (blocks % 1)) * block_size) if blocks % 1 else 0
        shape = Shape(prompt_blocks=int(-(-blocks // 1)), margin=margin, answer_blocks=1)
        for _ in range(settings.rounds_per_size):
            plan = await plan_conversation(index, seed, shape, block_size, max_model_len, treatment.count_tokens)
            own = f"{salt}-race-{index}"
            decode = racer_tokens(plan.turn1_prompt_tokens, block_size)

            async def ask(
                kind: str,
                messages: Sequence[Mapping[str, str]],
                cache_salt: str,
                *,
                forced: int | None = None,
                conv: int = index,
            ) -> Exchange:
                body = _body(messages, settings, cache_salt)
                if forced is not None:  # a fixed length, so the answer completes the block the prompt ends in
                    body |= {"max_tokens": forced, "min_tokens": forced, "ignore_eos": True}
                return record(await treatment.chat(body, conversation=conv, kind=kind))

            prompt = plan.turn1_messages
            racers = await asyncio.gather(
                *(ask(f"race-{j}", prompt, own, forced=decode) for j in range(settings.racers))
            )
            await ask("race-fresh", prompt, f"{own}-fresh", forced=decode)
            answer = next((e.text for e in racers if e.ok and e.text), "ok .")
            rng = random.Random(f"blackbox-race:{seed}:{index}")
            for f in range(settings.followups):
                # A block-long new question: under MTP the lookup drops the last matched block, so the follow-up
                # must run a block past the boundary it is meant to resume from.
                tail = " ".join(rng.choice(FILLER) for _ in range(block_size))
                follow = (
                    *prompt,
                    {
                        "role": "assistant",
                        "content": answer if resends_answer(f, plan.turn1_prompt_tokens, block_size) else "ok .",
                    },
                    {"role": "user", "content": f"{tail} . {question_for(rng.choice(NAMES))}"},
                )
                await ask(f"follow-{f}", follow, own)
                await ask(f"follow-{f}-fresh", follow, f"{own}-follow-{f}-fresh")
            rounds.append(RaceRound(index, blocks, plan.turn1_prompt_tokens, settings.racers, settings.followups))
            index += 1
    return rounds


def _compare(e: Exchange | None, ref: Exchange | None, hard_margin: float, length: int | None = None) -> Sample | None:
    # Without logprobs two answers compare equal vacuously: such answers are no evidence.
    if e is None or ref is None or not (e.ok and ref.ok and e.tokens and ref.tokens):
        return None
    mine, theirs = e.tokens[:length], ref.tokens[:length]
    # TokenLogprob equality is token, logprob and top-k alike: bit for bit.
    return Sample(e.conversation, e.kind, deviation(mine, theirs, hard_margin), mine != theirs)


def _samples(
    history: History, rounds: Sequence[RaceRound], hard_margin: float, tokens: int | None = None
) -> tuple[list[Sample], list[Sample], bool]:
    """One cold racer a round against recomputation, follow-ups that hit against theirs, and whether every cold
    racer was bit-identical to recomputation. Racers decode much longer than follow-ups, and a longer answer has
    more positions to deviate at, so a racer is compared over as many tokens as the round's longest follow-up
    answer: like against like. Both over `tokens` positions at most.

    A round's racers are all compared with the one recomputation of that round, so their deviations share its
    noise: a recomputation that lands off puts every racer of the round high together. Counted as several draws
    they make the yardstick look larger and surer than it is (simulated false alarms 4-9x nominal), so a round
    gives one draw: its first comparable cold racer, chosen by position, not by value. Whether the engine is exact
    for this geometry is read from every cold racer."""
    cold: list[Sample] = []
    hit: list[Sample] = []
    exact = True
    for r in rounds:
        follows = [
            (
                history.get(r.index, Arm.TREATMENT, f"follow-{f}"),
                history.get(r.index, Arm.TREATMENT, f"follow-{f}-fresh"),
            )
            for f in range(r.followups)
        ]
        length = max((len(e.tokens) for e, _ in follows if e is not None and e.ok), default=0) or None
        if tokens is not None:
            length = min(length or tokens, tokens)
        fresh = history.get(r.index, Arm.TREATMENT, "race-fresh")
        racers = [history.get(r.index, Arm.TREATMENT, f"race-{j}") for j in range(r.racers)]
        drawn = [
            s
            for e in racers
            if e is not None and not e.cached_tokens and (s := _compare(e, fresh, hard_margin, length))
        ]
        exact = exact and not any(s.differs for s in drawn)
        cold += drawn[:1]
        for e, e_fresh in follows:
            sample = _compare(e, e_fresh, hard_margin, tokens)
            if sample is not None and e is not None and e.cached_tokens:
                hit.append(sample)
    return cold, hit, exact


def race_divergence(
    history: History, rounds: Sequence[RaceRound], alpha: float, hard_margin: float, tokens: int | None = None
) -> Finding:
    """Follow-ups that resumed from race-written blocks against cold racers (the race's own chunking noise). Where
    every cold racer is bit-identical to recomputation the engine is exact for this geometry, so the count test
    counts any difference; otherwise confident flips (see `evidence`)."""
    cold, hit, exact = _samples(history, rounds, hard_margin, tokens)
    extra: dict[str, object] = {"distinct_outputs": _distinct_outputs(history, rounds)}
    if not hit or not cold:
        why = f"{len(hit)} follow-ups resumed from race-written blocks, {len(cold)} cold racers to calibrate on"
        return Finding.from_error("race-divergence", errors.NoEvidence(f"nothing to compare: {why}"), **extra)
    finding = judge_samples(
        "race-divergence",
        hit,
        cold,
        alpha=alpha,
        what="follow-ups resumed from race-written blocks",
        against="the cold racers'",
        runs=len(rounds),
        hint="replay the listed rounds with the commands in the run folder's replay/",
        run_unit="race rounds",
        exact=exact,
    )
    if "counted" in finding.figures:
        extra["mode"] = "exact" if finding.figures["counted"] == "differs" else "noise"
    return replace(finding, figures={**finding.figures, **extra})


def _distinct_outputs(history: History, rounds: Sequence[RaceRound]) -> dict[int, dict[str, int]]:
    """Per round: how many different answers the identical racers gave, and how many follow-ups' answers differ
    from their recomputation's (the text-level view of the same evidence)."""
    out: dict[int, dict[str, int]] = {}
    for r in rounds:
        racers = (history.get(r.index, Arm.TREATMENT, f"race-{j}") for j in range(r.racers))
        pairs = (
            (
                history.get(r.index, Arm.TREATMENT, f"follow-{f}"),
                history.get(r.index, Arm.TREATMENT, f"follow-{f}-fresh"),
            )
            for f in range(r.followups)
        )
        out[r.index] = {
            "racer_answers": len({e.text for e in racers if e is not None and e.ok}),
            "followups_differing": sum(a.text != b.text for a, b in pairs if a and b and a.ok and b.ok),
        }
    return out


async def send_liveness(
    treatment: Endpoint,
    seed: int,
    block_size: int,
    max_model_len: int,
    salt: str,
    record: Record,
) -> None:
    plan = await plan_conversation(
        LIVENESS,
        seed,
        Shape(prompt_blocks=4, margin=block_size // 2, answer_blocks=1),
        block_size,
        max_model_len,
        treatment.count_tokens,
    )
    body = {
        "messages": list(plan.turn1_messages),
        "temperature": 0.0,
        "max_tokens": 4,
        "cache_salt": f"{salt}-liveness",
    }
    for kind in ("liveness-1", "liveness-2"):
        record(await treatment.chat(body, conversation=LIVENESS, kind=kind))


ITERATION_TOKENS = "vllm:iteration_tokens_total_bucket"


def largest_step(window: MetricsDelta | None) -> float | None:
    """Upper bound on the tokens of any engine step in the window, from the `iteration_tokens` histogram."""
    if window is None:
        return None
    buckets = window.per_label(ITERATION_TOKENS, "le")
    if not buckets:
        return None
    total = buckets.get("+Inf", max(buckets.values()))
    if total <= 0:  # no step counted in the window: its size is unknown, not the smallest bucket
        return None
    bounds = sorted((float(le), n) for le, n in buckets.items() if le != "+Inf")
    return next((le for le, n in bounds if n >= total), float("inf"))


def fragmentation(
    history: History, rounds: tuple[RaceRound, ...], window: MetricsDelta | None, budget: int | None
) -> Finding:
    """A round's cold prompt tokens exceeded the largest step the server took (or its stated budget), so its
    prefills were split over several steps: the condition A1 needs."""
    step = float(budget) if budget else largest_step(window)
    computed = {r.index: _computed(history, r) for r in rounds}
    figures: dict[str, object] = {
        "largest_step_tokens": step,
        "stated_budget": budget,
        "round_computed_tokens": computed,
    }
    if step is None:
        return Finding.from_error(
            "race-trigger",
            errors.TriggerNotExercised(
                "cannot tell whether the race fragmented prefills: no vllm:iteration_tokens_total histogram",
                hint="pass --max-num-batched-tokens N (the treatment's step budget)",
            ),
            **figures,
        )
    fragmented = [i for i, n in computed.items() if n > step]
    resumed = [r.index for r in rounds if any(_followup_hit(history, r, f) for f in range(r.followups))]
    figures["rounds_resumed"] = resumed
    if not fragmented:
        return Finding.from_error(
            "race-trigger",
            errors.TriggerNotExercised(
                f"no race round computed more prompt tokens than one step holds ({step:g}): prefills were not split",
                hint="start the treatment with a small --max-num-batched-tokens (profile cpu-tiny-fragmented) or "
                "raise --racers",
            ),
            **figures,
        )
    if not set(fragmented) & set(resumed):
        return Finding.from_error(
            "race-trigger",
            errors.TriggerNotExercised(
                f"no follow-up resumed from a block written by a fragmented race round (fragmented {fragmented}, "
                f"resumed {resumed})",
                hint="raise --racers or the prompt sizes",
            ),
            **figures,
        )
    return Finding.passed(
        "race-trigger",
        f"{len(fragmented)} of {len(rounds)} rounds computed more prompt tokens "
        f"than one step holds ({step:g}): prefills were fragmented",
        **figures,
    )


def _followup_hit(history: History, r: RaceRound, f: int) -> bool:
    e = history.get(r.index, Arm.TREATMENT, f"follow-{f}")
    return e is not None and e.ok and bool(e.cached_tokens)


def _computed(history: History, r: RaceRound) -> int:
    racers = (history.get(r.index, Arm.TREATMENT, f"race-{j}") for j in range(r.racers))
    return sum((e.prompt_tokens or 0) - (e.cached_tokens or 0) for e in racers if e is not None and e.ok)


def liveness(history: History) -> Finding:
    second = history.get(LIVENESS, Arm.TREATMENT, "liveness-2")
    cached = second.cached_tokens if second is not None and second.ok else None
    if not cached:
        return Finding.from_error(
            "race-liveness",
            errors.CacheNotLive(
                f"a prompt of 3+ blocks sent twice did not hit the cache (cached_tokens {cached})",
                hint="is prefix caching on, and --enable-prompt-tokens-details set, on the treatment?",
            ),
            cached_tokens=cached,
        )
    return Finding.passed("race-liveness", f"a 3+ block prompt sent twice hit {cached} tokens", cached_tokens=cached)


def _grade(history: History, grading: Grading, alpha: float) -> Finding:
    n = compared_positions(history, grading)
    return with_positions(n, race_divergence(history, history.races, alpha, grading.hard_margin, n))


class ColdRace(Probe):
    name = "cold-race"
    about = "concurrent cold prefills under a small step budget (A1)"

    async def drive(self, ctx: DriveContext) -> Driven:
        """The race rounds between two settled snapshots (the window proves fragmentation), then the liveness
        pair."""
        config, treatment, geo = ctx.config, ctx.treatment, ctx.geometry
        ctx.progress(0, 0, "cold race")
        found: list[Exchange] = []

        def keep(e: Exchange) -> Exchange:
            found.append(ctx.record(e))
            return found[-1]

        before = await settle(treatment, config.settle_s)
        rounds = await drive(treatment, config.race, config.seed, geo.block_size, geo.max_model_len, ctx.salt, keep)
        window = MetricsDelta(before, await settle(treatment, config.settle_s))
        ctx.store.write_text("metrics/race-window/before.prom", window.before.text)
        ctx.store.write_text("metrics/race-window/after.prom", window.after.text)
        await send_liveness(treatment, config.seed, geo.block_size, geo.max_model_len, ctx.salt, keep)
        ctx.store.write_json(
            "race.json", {"budget": config.max_num_batched_tokens, "rounds": [r.__dict__ for r in rounds]}
        )
        return Driven(exchanges=tuple(found), races=tuple(rounds), race_window=window)

    def gates(self, history: History, grading: Grading) -> list[Finding]:
        return [fragmentation(history, history.races, history.race_window, history.step_budget), liveness(history)]

    def graders(self, grading: Grading) -> list[Grader]:
        return [Grader("race-divergence", _grade, covers_trigger=True)]

    def required(self, grading: Grading) -> frozenset[str]:
        return frozenset({"race-divergence"})  # its only grader: without evidence the run is UNKNOWN


COLD_RACE = ColdRace()
