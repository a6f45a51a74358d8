"""The cold-race probe: the write side of the cache (mechanism A1, vLLM #45477).

K identical cold prompts of 1-3 blocks go to the treatment at once, so their prefills share a small token budget
and are cut into chunks; a state stored at a chunk end instead of a block boundary is then cached under the
boundary's hash. Each round re-sends the prompt once more on the same salt (resuming from whatever the race
cached) and once on a fresh salt (recomputation). Every hit here ends in the prefill-written region, where a
correct engine is bit-exact, so every race and re-hit answer must equal recomputation.

Its trigger proof: a round computed more prompt tokens than the largest engine step the server reports in its
`vllm:iteration_tokens_total` histogram over the race (or than a stated `--max-num-batched-tokens`), so the
prefills really were split over steps; and a prompt of 3+ blocks sent twice hits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from blackbox import errors
from blackbox.client import Endpoint
from blackbox.history import Arm, Exchange, History, TokenLogprob
from blackbox.metrics import MetricsDelta
from blackbox.verdict import Finding
from blackbox.workload import Shape, plan_conversation

__all__ = [
    "RaceRound",
    "RaceSettings",
    "drive",
    "fragmentation",
    "largest_step",
    "liveness",
    "race_exactness",
    "send_liveness",
]

LIVENESS = 10_000  # conversation ids of the liveness pair
FIRST_ROUND = 1_000  # conversation ids of race rounds start here


@dataclass(frozen=True)
class RaceSettings:
    racers: int = 8
    rounds_per_size: int = 3
    sizes: tuple[float, ...] = (1.5, 2.5)  # prompt length in blocks
    max_tokens: int = 16
    top_logprobs: int = 5


@dataclass(frozen=True)
class RaceRound:
    index: int
    blocks: float
    prompt_tokens: int
    racers: int


async def drive(
    treatment: Endpoint,
    settings: RaceSettings,
    seed: int,
    block_size: int,
    max_model_len: int,
    salt: str,
    record: Callable[[Exchange], Exchange],
) -> list[RaceRound]:
    rounds: list[RaceRound] = []
    index = FIRST_ROUND
    for blocks in settings.sizes:
        margin = round((1 - (blocks % 1)) * block_size) if blocks % 1 else 0
        shape = Shape(prompt_blocks=int(-(-blocks // 1)), margin=margin, answer_blocks=1)
        for _ in range(settings.rounds_per_size):
            plan = await plan_conversation(index, seed, shape, block_size, max_model_len, treatment.count_tokens)
            body = {
                "messages": list(plan.turn1_messages),
                "temperature": 0.0,
                "logprobs": True,
                "top_logprobs": settings.top_logprobs,
                "max_tokens": settings.max_tokens,
            }
            own = f"{salt}-race-{index}"

            async def ask(kind: str, cache_salt: str, conv: int = index, b: dict = body) -> Exchange:
                return record(await treatment.chat({**b, "cache_salt": cache_salt}, conversation=conv, kind=kind))

            await asyncio.gather(*(ask(f"race-{j}", own) for j in range(settings.racers)))
            await ask("race-rehit", own)
            await ask("race-fresh", f"{own}-fresh")
            rounds.append(RaceRound(index, blocks, plan.turn1_prompt_tokens, settings.racers))
            index += 1
    return rounds


async def send_liveness(
    treatment: Endpoint,
    seed: int,
    block_size: int,
    max_model_len: int,
    salt: str,
    record: Callable[[Exchange], Exchange],
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


def _same(a: tuple[TokenLogprob, ...], b: tuple[TokenLogprob, ...]) -> bool:
    return len(a) == len(b) and all(
        x.token == y.token and x.logprob == y.logprob and x.top == y.top for x, y in zip(a, b, strict=True)
    )


def race_exactness(history: History, rounds: tuple[RaceRound, ...]) -> Finding:
    if not rounds:
        return Finding.from_error("race-exactness", errors.NoEvidence("no cold-race round ran"))
    mismatched: list[dict[str, object]] = []
    distinct: list[int] = []
    checked = 0
    for r in rounds:
        fresh = history.get(r.index, Arm.TREATMENT, "race-fresh")
        answers = [history.get(r.index, Arm.TREATMENT, f"race-{j}") for j in range(r.racers)]
        answers.append(history.get(r.index, Arm.TREATMENT, "race-rehit"))
        # Without logprobs two answers compare equal vacuously: such answers are no evidence.
        ok = [a for a in answers if a is not None and a.ok and a.tokens]
        if fresh is None or not fresh.ok or not fresh.tokens or not ok:
            continue
        distinct.append(len({tuple(t.token for t in a.tokens) for a in ok}))
        for a in ok:
            checked += 1
            if not _same(a.tokens, fresh.tokens):
                mismatched.append({"round": r.index, "kind": a.kind, "cached_tokens": a.cached_tokens})
    figures = {"checked": checked, "mismatches": mismatched, "distinct_outputs_per_round": distinct}
    if not checked:
        return Finding.from_error("race-exactness", errors.NoEvidence("no race round has a recomputation to compare"))
    if mismatched:
        rounds_hit = sorted({int(str(m["round"])) for m in mismatched})
        return Finding.from_error(
            "race-exactness",
            errors.CorruptionDetected(
                f"{len(mismatched)} of {checked} cold-race answers differ from recomputation on the same server "
                f"(rounds {rounds_hit}; distinct outputs per round {distinct}); a correct engine is bit-exact here",
                hint="replay the listed rounds with the commands in the run folder's replay/",
            ),
            **figures,
        )
    return Finding.passed(
        "race-exactness",
        f"{checked} cold-race answers identical to recomputation ({len(distinct)} rounds, one distinct output each)",
        **figures,
    )


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
    figures = {"largest_step_tokens": step, "stated_budget": budget, "round_computed_tokens": computed}
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
    return Finding.passed(
        "race-trigger",
        f"{len(fragmented)} of {len(rounds)} rounds computed more prompt tokens "
        f"than one step holds ({step:g}): prefills were fragmented",
        **figures,
    )


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
