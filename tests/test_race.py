"""The cold-race probe's checkers on hand-built histories: the deviation of one answer from its recomputation,
race divergence (follow-ups that resumed from race-written blocks against the cold racers' chunking noise), the
fragmentation and liveness gates, the step size read from `vllm:iteration_tokens_total`, and how `--probe` picks
gates and graders.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import pytest

from blackbox import errors, gates, graders, metrics, stats
from blackbox.client import Endpoint
from blackbox.compare import deviation
from blackbox.config import Grading
from blackbox.history import Arm, Exchange, History, Kind, RaceRound, TokenLogprob
from blackbox.metrics import MetricsDelta
from blackbox.probes import cold_race as race
from blackbox.verdict import Finding, Status, merge

import histories as h

GRADING = Grading()
INF = float("inf")
R0 = race.FIRST_ROUND
RACERS = 4
FOLLOWUPS = 2
PROMPT = 40  # 2.5 blocks of 16: every racer's prompt
FOLLOW_PROMPT = PROMPT + h.BLOCK + 12  # the prompt, a short answer and a block-long new question
FOLLOW_CACHED = 2 * h.BLOCK  # a follow-up resumes from the two full blocks the race wrote
WORDS = ["alpha", "bravo", "two"]
ANSWER = h.tokens(-0.1, -0.2, -0.3, words=WORDS)  # every alternative 2 nats below: confident
TIED = h.tokens(-0.1, -0.2, -0.3, words=WORDS, margin=0.5)  # the same answer, every position a near-tie
FLIPPED = h.tokens(-0.1, -0.2, -0.3, words=["alpha", "bravo", "three"])  # parts from ANSWER at its last token
FLIPPED_TIED = h.tokens(-0.1, -0.2, -0.3, words=["alpha", "bravo", "three"], margin=0.5)  # ... and from TIED
BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # vLLM's iteration_tokens buckets, trimmed
EARLIER = (2000, 700, 40, 1)  # steps taken before the race window opened (the multiturn probe, warm-up)
RACE_GATES = ["endpoints", "logprobs", "counters", "cache-live", "race-trigger", "race-liveness"]
MULTITURN_GATES = ["endpoints", "logprobs", "counters", "cache-live", "trigger", "drafter-live"]

# Deviations from recomputation, in nats: the cold racers' chunking noise (one draw in each of 12 rounds),
# follow-ups far above it and follow-ups inside it (2 a round).
COLD = tuple(0.01 + 0.05 * i / 11 for i in range(12))  # 0.01 .. 0.06
FAR = tuple(0.3 + 0.3 * i / 23 for i in range(24))  # 0.3 .. 0.6
NEAR = tuple(0.01 + 0.05 * i / 23 for i in range(24))  # 0.01 .. 0.06

# A treatment whose cache hits but which has no drafter: the multiturn drafter gate would fail on it.
NO_DRAFTER = h.live_delta(DRAFTS=None, DRAFT_TOKENS=None, ACCEPTED=None, ACCEPTED_PER_POS=None)

# Racers that answer alike are one draw of the noise (`race._samples`), so a round of identical exact racers
# calibrates once: exact-mode histories need rounds, not racers. With one follow-up differing in each of N
# rounds (N of 2N against 0 of N) the count test reaches C(2N, N) / C(3N, N) < alpha/3 from N = 12.
EXACT_ROUNDS = 12

Answer = float | Sequence[TokenLogprob]


# --- builders -----------------------------------------------------------------------------------------------


def shifted(d: float) -> tuple[TokenLogprob, ...]:
    """ANSWER with its first chosen logprob moved down by `d` nats: the same tokens, deviation `d`."""
    return h.tokens(-0.1 - d, -0.2, -0.3, words=WORDS)


def as_tokens(a: Answer) -> Sequence[TokenLogprob]:
    return shifted(a) if isinstance(a, float) else a


def kinds(racers: int = RACERS, followups: int = FOLLOWUPS) -> list[str]:
    follow = [k for f in range(followups) for k in (f"follow-{f}", f"follow-{f}-fresh")]
    return [*(f"race-{j}" for j in range(racers)), "race-fresh", *follow]


def answer(
    index: int,
    kind: str,
    toks: Sequence[TokenLogprob] = ANSWER,
    *,
    prompt: int = PROMPT,
    cached: int | None = 0,
    error: str | None = None,
) -> Exchange:
    e = h.exchange(index, Arm.TREATMENT, kind, cached=cached, toks=toks, text="alpha bravo two", error=error)
    return dataclasses.replace(e, prompt_tokens=None if error else prompt)


def round_exchanges(
    index: int,
    *,
    racers: int = RACERS,
    followups: int = FOLLOWUPS,
    prompt: int = PROMPT,
    toks: Mapping[str, Sequence[TokenLogprob]] | None = None,
    cached: Mapping[str, int | None] | None = None,
    failed: Sequence[str] = (),
    drop: Sequence[str] = (),
) -> list[Exchange]:
    """One round: cold racers, the recomputation, and follow-ups that hit FOLLOW_CACHED tokens with their own
    recomputations, all answering ANSWER. `toks` and `cached` map a kind to its own tokens or cached_tokens,
    `failed` kinds carry an error, `drop` kinds were never recorded."""
    toks, cached = toks or {}, cached or {}
    out = []
    for kind in kinds(racers, followups):
        if kind in drop:
            continue
        follow = kind.startswith("follow-")
        resumed = follow and not kind.endswith("-fresh")
        out.append(
            answer(
                index,
                kind,
                toks.get(kind, ANSWER),
                prompt=FOLLOW_PROMPT if follow else prompt,
                cached=cached.get(kind, FOLLOW_CACHED if resumed else 0),
                error="HTTP 500: engine error" if kind in failed else None,
            )
        )
    return out


def uncached_followups(followups: int = FOLLOWUPS) -> dict[str, int | None]:
    return {f"follow-{f}": 0 for f in range(followups)}


def rnd(index: int, *, racers: int = RACERS, followups: int = FOLLOWUPS, prompt: int = PROMPT) -> RaceRound:
    return RaceRound(index, 2.5, prompt, racers, followups)


def liveness_pair(cached: int | None = 3 * h.BLOCK, *, error: str | None = None) -> list[Exchange]:
    return [
        h.exchange(race.LIVENESS, Arm.TREATMENT, "liveness-1", cached=0),
        h.exchange(race.LIVENESS, Arm.TREATMENT, "liveness-2", cached=cached, error=error),
    ]


def iteration_text(*engines: Sequence[int]) -> str:
    """The LIVE counters plus an `iteration_tokens` histogram as vLLM exposes it, one engine per step list."""
    lines = [
        "# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.",
        "# TYPE vllm:iteration_tokens_total histogram",
    ]
    for e, steps in enumerate(engines):
        labels = f'engine="{e}",model_name="tiny"'
        lines.append(f"vllm:iteration_tokens_total_sum{{{labels}}} {float(sum(steps))}")
        for b in BOUNDS:
            below = sum(1 for s in steps if s <= b)
            lines.append(
                f'vllm:iteration_tokens_total_bucket{{engine="{e}",le="{float(b)}",model_name="tiny"}} {below}.0'
            )
        lines.append(f'vllm:iteration_tokens_total_bucket{{engine="{e}",le="+Inf",model_name="tiny"}} {len(steps)}.0')
        lines.append(f"vllm:iteration_tokens_total_count{{{labels}}} {len(steps)}.0")
    lines += [
        "# HELP vllm:iteration_tokens_total_created Histogram of number of tokens per engine_step.",
        "# TYPE vllm:iteration_tokens_total_created gauge",
    ]
    lines += [
        f'vllm:iteration_tokens_total_created{{engine="{e}",model_name="tiny"}} 1.7e9' for e in range(len(engines))
    ]
    return h.prom(h.LIVE) + "\n".join(lines) + "\n"


def window(*during: int, before: Sequence[int] = EARLIER) -> MetricsDelta:
    """The treatment's counters over the race: `before` steps already counted, `during` steps taken in it."""
    return MetricsDelta(metrics.parse(iteration_text(before)), metrics.parse(iteration_text([*before, *during])))


def race_history(
    exchanges: Sequence[Exchange],
    rounds: Sequence[RaceRound],
    *,
    race_window: MetricsDelta | None = None,
    budget: int | None = None,
    deltas: Mapping[str, MetricsDelta] | None = None,
) -> History:
    deltas = {Arm.TREATMENT: NO_DRAFTER} if deltas is None else deltas
    return History(h.BLOCK, (), tuple(exchanges), dict(deltas), tuple(rounds), budget, race_window)


def healthy_race(n: int = 2, **changes: object) -> History:
    """n clean rounds of RACERS x PROMPT = 160 cold tokens whose follow-ups resumed, steps of at most 128 tokens,
    and a live cache; every answer identical to its recomputation."""
    exchanges = [e for i in range(n) for e in round_exchanges(R0 + i)]
    fields: dict[str, object] = {"race_window": window(128, 128, 32, 16, 8)}
    fields.update(changes)
    history = race_history([*exchanges, *liveness_pair()], [rnd(R0 + i) for i in range(n)])
    return dataclasses.replace(history, **fields)


def repeated(n: int, **changes: Any) -> History:
    """`healthy_race(n)` with the same `round_exchanges` changes (toks, cached, failed, drop) in every round: a
    fault seen once a round, often enough for the tests to have power."""
    return with_rounds(healthy_race(n), *(round_exchanges(R0 + i, **changes) for i in range(n)))


def with_rounds(history: History, *rounds: Sequence[Exchange]) -> History:
    """`history` with its race answers replaced by `rounds` (the liveness pair kept)."""
    liveness = [e for e in history.exchanges if e.conversation == race.LIVENESS]
    return dataclasses.replace(history, exchanges=(*(e for r in rounds for e in r), *liveness))


def deviating_race(
    cold: Sequence[Answer],
    hits: Sequence[Answer],
    *,
    racers: int = 4,
    follow_fresh: Sequence[TokenLogprob] = ANSWER,
) -> History:
    """One round per cold draw: its `racers` cold racers all answer cold[i] (a float meaning ANSWER shifted by it)
    against race-fresh's ANSWER, and its len(hits) / len(cold) resumed follow-ups answer hits round-major, each
    against its own recomputation `follow_fresh`."""
    n, followups = len(cold), len(hits) // len(cold)
    assert n * followups == len(hits), "whole rounds only"
    exchanges: list[Exchange] = []
    for i in range(n):
        toks = {f"race-{j}": as_tokens(cold[i]) for j in range(racers)}
        toks |= {f"follow-{f}": as_tokens(hits[i * followups + f]) for f in range(followups)}
        toks |= {f"follow-{f}-fresh": follow_fresh for f in range(followups)}
        exchanges += round_exchanges(R0 + i, racers=racers, followups=followups, toks=toks)
    rounds = [rnd(R0 + i, racers=racers, followups=followups) for i in range(n)]
    return race_history([*exchanges, *liveness_pair()], rounds, race_window=window(128, 128, 32))


def followup_ids(which: Sequence[int], followups: int = 2) -> list[tuple[int, str]]:
    """(round, kind) of follow-ups `which`, numbered round-major as in `deviating_race`."""
    return [(R0 + i // followups, f"follow-{i % followups}") for i in which]


def listed(finding: Finding) -> list[tuple[int, str]]:
    """(round, kind) of each follow-up a finding lists as beyond the cold racers."""
    return [(m["unit"], m["kind"]) for m in finding.figures["mismatches"]]


def divergence(history: History, *, alpha: float = GRADING.alpha, hard_margin: float = GRADING.hard_margin) -> Finding:
    return race.race_divergence(history, history.races, alpha, hard_margin)


def fragmentation(history: History) -> Finding:
    return race.fragmentation(history, history.races, history.race_window, history.step_budget)


def assert_unknown(finding: Finding, error: type[errors.BlackboxError]) -> None:
    assert finding.status is Status.UNKNOWN, finding.reason
    assert finding.error_class == error.__name__
    assert merge([finding]).exit_code == error.exit_code


def assert_corruption(finding: Finding) -> None:
    assert finding.status is Status.FAIL, finding.reason
    assert finding.check == "race-divergence"
    assert finding.error_class == "CorruptionDetected"
    assert "replay/" in finding.hint
    assert merge([finding]).exit_code == errors.CorruptionDetected.exit_code


# --- drive: what the race sends ----------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "decode"), [(192, 96), (320, 96), (256, 32), (250, 38), (129, 159)])
def test_racers_decode_through_the_block_their_prompt_ends_in(prompt: int, decode: int) -> None:
    assert race.racer_tokens(prompt, 128) == decode


def test_short_prompts_always_resend_the_answer_longer_ones_alternate() -> None:
    assert [race.resends_answer(f, 192, 128) for f in range(4)] == [True] * 4  # 1.5 blocks: "ok ." cannot hit
    assert [race.resends_answer(f, 320, 128) for f in range(4)] == [False, True, False, True]


class ScriptedTreatment:
    """Counts a word as a token and answers every chat with the same words; keeps each request body."""

    ANSWER = "the code is 42"

    def __init__(self) -> None:
        self.bodies: dict[tuple[int, str], dict[str, Any]] = {}

    async def count_tokens(self, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool = True) -> int:
        return sum(len(m["content"].split()) for m in messages)

    async def chat(self, body: Mapping[str, Any], *, conversation: int, kind: str) -> Exchange:
        self.bodies[conversation, kind] = dict(body)
        words = len(body["messages"][0]["content"].split())
        e = h.exchange(conversation, Arm.TREATMENT, kind, cached=0, text=self.ANSWER)
        return dataclasses.replace(e, prompt_tokens=words)


async def test_drive_forces_racer_lengths_and_resends_their_answer() -> None:
    fake = ScriptedTreatment()
    settings = race.RaceSettings(racers=3, rounds_per_size=1, sizes=(1.5, 2.5), followups=2)
    recorded: list[Exchange] = []
    rounds = await race.drive(cast(Endpoint, fake), settings, 7, 128, 4096, "salt", lambda e: recorded.append(e) or e)
    assert [(r.blocks, r.racers, r.followups) for r in rounds] == [(1.5, 3, 2), (2.5, 3, 2)]
    assert len(recorded) == len(fake.bodies) == 2 * (3 + 1 + 2 * 2)
    for r in rounds:
        decode = race.racer_tokens(r.prompt_tokens, 128)
        for kind in ("race-0", "race-1", "race-2", "race-fresh"):
            body = fake.bodies[r.index, kind]
            assert body["max_tokens"] == body["min_tokens"] == decode and body["ignore_eos"] is True
            assert body["logprobs"] is True
        assert fake.bodies[r.index, "race-0"]["cache_salt"] == fake.bodies[r.index, "race-2"]["cache_salt"]
        assert fake.bodies[r.index, "race-fresh"]["cache_salt"] != fake.bodies[r.index, "race-0"]["cache_salt"]
        for f in range(2):
            follow, fresh = fake.bodies[r.index, f"follow-{f}"], fake.bodies[r.index, f"follow-{f}-fresh"]
            assert follow["messages"] == fresh["messages"] and follow["cache_salt"] != fresh["cache_salt"]
            assert follow["cache_salt"] == fake.bodies[r.index, "race-0"]["cache_salt"]  # resumes the race's blocks
            assert "min_tokens" not in follow and follow["max_tokens"] == settings.max_tokens
            expected = fake.ANSWER if race.resends_answer(f, r.prompt_tokens, 128) else "ok ."
            assert follow["messages"][-2] == {"role": "assistant", "content": expected}
    # 1.5 blocks: both follow-ups re-send the answer; 2.5 blocks: the first says "ok .", the second re-sends.
    assert [fake.bodies[rounds[1].index, f"follow-{f}"]["messages"][-2]["content"] for f in range(2)] == [
        "ok .",
        fake.ANSWER,
    ]


# --- deviation ----------------------------------------------------------------------------------------------


def test_identical_answers_deviate_by_nothing() -> None:
    assert deviation(ANSWER, ANSWER, 1.0) == 0.0
    assert deviation(TIED, TIED, 1.0) == 0.0


def test_the_deviation_is_the_largest_logprob_gap() -> None:
    fresh = h.tokens(-0.1, -0.2, -0.35, -0.4, words=["a", "b", "c", "d"])
    other = h.tokens(-0.15, -0.5, -0.3, -0.4, words=["a", "b", "c", "d"])
    assert deviation(other, fresh, 1.0) == pytest.approx(0.3)
    assert deviation(fresh, other, 1.0) == pytest.approx(0.3)  # |Δ|: either side may be lower


def test_an_alternative_moving_is_a_deviation() -> None:
    # The same chosen tokens and logprobs, but every runner-up 0.5 nats lower: the next-token distribution moved.
    assert deviation(h.tokens(-0.1, -0.2, -0.3, words=WORDS, margin=2.5), ANSWER, 1.0) == pytest.approx(0.5)


def test_only_tokens_both_sides_list_are_compared() -> None:
    fresh = (TokenLogprob("a", -0.1, (("a", -0.1), ("b", -2.0), ("c", -3.0))),)
    other = (TokenLogprob("a", -0.1, (("a", -0.1), ("b", -2.3), ("d", -2.5))),)  # c and d: one side only
    assert deviation(other, fresh, 1.0) == pytest.approx(0.3)


def test_a_near_tie_flip_counts_its_own_position_and_ends_the_comparison() -> None:
    fresh = h.tokens(-0.1, -0.2, -0.3, -0.4, words=["a", "b", "c", "d"], margin=0.5)
    # The gaps after the flip are not counted.
    other = h.tokens(-0.15, -0.3, -5.0, -9.0, words=["a", "b", "x", "d"], margin=0.5)
    assert deviation(other, fresh, 1.0) == pytest.approx(0.1)
    # At the flip the context is still shared: c listed by both moved by 1.2, and that counts.
    flipped = (*other[:2], TokenLogprob("x", -0.5, (("x", -0.5), ("c", -1.5))), *other[3:])
    assert deviation(flipped, fresh, 1.0) == pytest.approx(1.2)


def test_a_near_tie_flip_at_the_first_token_compares_that_position() -> None:
    # Recomputation chose a over x by 0.1; the answer chose x over a by 0.4: a moved by 0.4, x by 0.1.
    fresh = (TokenLogprob("a", -0.6, (("a", -0.6), ("x", -0.7))), *h.tokens(-0.2, words=["b"]))
    other = (TokenLogprob("x", -0.4, (("x", -0.4), ("a", -1.0))), *h.tokens(-0.2, words=["b"]))
    assert deviation(other, fresh, 1.0) == pytest.approx(0.4)
    assert deviation(fresh, fresh, 1.0) == 0.0


def test_a_near_tie_flip_forgives_the_lengths_parting_after_it() -> None:
    fresh = h.tokens(-0.1, -0.2, -0.3, words=WORDS, margin=0.5)
    shorter = h.tokens(-0.12, -0.2, words=["alpha", "charlie"], margin=0.5)
    assert deviation(shorter, fresh, 1.0) == pytest.approx(0.02)


@pytest.mark.parametrize("margin", [1.0, 2.0, 7.5])
def test_a_flip_where_recomputation_was_sure_is_infinite(margin: float) -> None:
    fresh = h.tokens(-0.5, -0.5, words=["a", "b"], margin=margin)  # margin exactly representable: 1.0 is >= 1.0
    assert fresh[1].margin == margin
    assert deviation(h.tokens(-0.5, -0.5, words=["a", "x"]), fresh, 1.0) == INF


def test_the_hard_margin_decides_what_a_confident_flip_is() -> None:
    assert deviation(FLIPPED, ANSWER, 1.0) == INF  # ANSWER's margins are 2 nats
    assert deviation(FLIPPED, ANSWER, 2.5) == 0.0
    assert deviation(FLIPPED_TIED, TIED, 1.0) == 0.0  # TIED's are 0.5


@pytest.mark.parametrize(
    "other",
    [h.tokens(-0.1, -0.2, words=WORDS[:2]), h.tokens(-0.1, -0.2, -0.3, -0.4, words=[*WORDS, "more"])],
    ids=["shorter", "longer"],
)
def test_answers_of_different_lengths_deviate_infinitely(other: tuple[TokenLogprob, ...]) -> None:
    assert deviation(other, ANSWER, 1.0) == INF
    assert deviation(ANSWER, other, 1.0) == INF


# --- race_divergence: exact mode ----------------------------------------------------------------------------
# Every cold racer bit-identical to recomputation: the count test counts any difference (`counted == "differs"`).


def test_everything_identical_to_recomputation_passes_in_exact_mode() -> None:
    finding = divergence(healthy_race(8))
    assert finding.status is Status.PASS, finding.reason
    assert finding.check == "race-divergence"
    assert (finding.figures["mode"], finding.figures["counted"]) == ("exact", "differs")
    # one draw a round: the RACERS identical racers of a round are one answer
    assert finding.figures["n_yardstick"] == finding.figures["yardstick_identical"] == 8
    assert finding.figures["n_subject"] == finding.figures["subject_identical"] == 8 * FOLLOWUPS
    assert finding.figures["mismatches"] == []
    zero = {"n": 16, "hard": 0, "median": 0.0, "p95": 0.0, "max_finite": 0.0}
    assert finding.figures["subject_deviation"] == zero
    # a PASS states what it could have seen: any difference, in a fraction of follow-ups, at power 0.95
    assert "any difference from recomputation in >= " in finding.reason
    assert "would have been detected with probability 0.95" in finding.reason
    assert 0 < finding.figures["detectable_fraction"] <= 1
    # graded (stage "grader", covering the race's trigger), it alone makes the run PASS
    assert merge(graders.grade(healthy_race(8), GRADING, probes=("cold-race",)).findings).exit_code == 0


@pytest.mark.parametrize(
    "toks",
    [
        shifted(1e-7),  # the chosen token's logprob
        h.tokens(-0.1, -0.2, -0.3, words=WORDS, margin=2.0001),  # an alternative's logprob only
        h.tokens(-0.1, -0.2, -0.3, words=["alpha", "bravo", "three"]),  # a token
        h.tokens(-0.1, -0.2, words=WORDS[:2]),  # shorter
    ],
    ids=["chosen-logprob", "top-logprob", "token", "length"],
)
def test_followups_differing_while_cold_racers_are_exact_are_corruption(toks: tuple[TokenLogprob, ...]) -> None:
    # One differing follow-up is no longer enough on its own (see the next test): follow-1 differs in each of 12
    # rounds, 12 of 24 follow-ups against 0 of 12 exact racer draws, Fisher p = C(24,12)/C(36,12) < alpha/3.
    n = EXACT_ROUNDS
    finding = divergence(repeated(n, toks={"follow-1": toks}))
    assert_corruption(finding)
    assert (finding.figures["mode"], finding.figures["counted"]) == ("exact", "differs")
    assert listed(finding) == [(R0 + i, "follow-1") for i in range(n)]
    assert (finding.figures["subject_count"], finding.figures["yardstick_count"]) == (n, 0)
    assert finding.figures["subject_identical"] == n
    assert finding.figures["p_values"]["count"] == pytest.approx(math.comb(2 * n, n) / math.comb(3 * n, n))
    assert f"{n}/{2 * n} differ from recomputation vs 0/{n}" in finding.reason


def test_one_differing_followup_among_exact_racers_is_not_enough() -> None:
    # The old rule failed on any single difference against exact racers. Now the count test must be significant:
    # 1 of 16 follow-ups against 0 of 8 racer draws is Fisher p = 16/24, so the run passes, the follow-up still
    # listed.
    history = with_rounds(
        healthy_race(8),
        *(round_exchanges(R0 + i, toks={"follow-1": FLIPPED} if i == 1 else None) for i in range(8)),
    )
    finding = divergence(history)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["p_values"]["count"] == pytest.approx(16 / 24)
    assert listed(finding) == [(R0 + 1, "follow-1")]
    # the same follow-ups differing in every round is corruption
    assert_corruption(divergence(repeated(8, toks={f"follow-{f}": FLIPPED for f in range(FOLLOWUPS)})))


def test_a_logprob_differing_without_alternatives_listed_is_corruption() -> None:
    bare = tuple(TokenLogprob(t.token, t.logprob) for t in ANSWER)  # top_logprobs not returned
    other = (bare[0], TokenLogprob("bravo", -0.2000001), bare[2])
    toks = {kind: bare for kind in kinds()} | {"follow-0": other}
    finding = divergence(repeated(EXACT_ROUNDS, toks=toks))
    assert_corruption(finding)
    assert listed(finding) == [(R0 + i, "follow-0") for i in range(EXACT_ROUNDS)]


def test_a_followup_is_judged_against_its_own_recomputation() -> None:
    # follow-0 and its recomputation agree, and both differ from race-fresh: no finding.
    agree = divergence(repeated(EXACT_ROUNDS, toks={"follow-0": FLIPPED, "follow-0-fresh": FLIPPED}))
    assert agree.status is Status.PASS, agree.reason
    # follow-0 agrees with race-fresh but not with its own recomputation: corruption.
    finding = divergence(repeated(EXACT_ROUNDS, toks={"follow-0-fresh": FLIPPED}))
    assert_corruption(finding)
    assert listed(finding) == [(R0 + i, "follow-0") for i in range(EXACT_ROUNDS)]


def test_one_inexact_cold_racer_switches_to_noise_mode() -> None:
    follow = {"follow-0": shifted(1e-7)}
    n = EXACT_ROUNDS
    assert_corruption(divergence(repeated(n, toks=follow)))
    # One racer off by 0.06 is enough to leave exact mode: confident flips are counted, not differences.
    one = with_rounds(
        repeated(n),
        round_exchanges(R0, toks=follow | {"race-2": shifted(0.06)}),
        *(round_exchanges(R0 + i, toks=follow) for i in range(1, n)),
    )
    switched = divergence(one)
    assert (switched.figures["mode"], switched.figures["counted"]) == ("noise", "hard")
    # every round is one draw, its first racer: race-2 decided the mode without being a draw
    assert (switched.figures["n_yardstick"], switched.figures["yardstick_identical"]) == (n, n)
    assert switched.figures["yardstick_deviation"]["max_finite"] == 0.0
    # Noise mode still compares whole distributions (a rank test): follow-ups at 1e-7 against racers at 0 bar one
    # shift upwards. With the drawn racer off by 0.06 in every round, 1e-7 is inside the racers' noise and passes.
    finding = divergence(repeated(6, toks=follow | {"race-0": shifted(0.06)}))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["mode"] == "noise"
    assert (finding.figures["n_yardstick"], finding.figures["yardstick_identical"]) == (6, 0)


def test_a_round_too_small_to_fail_is_insufficient_power() -> None:
    # 2 follow-ups against 4 identical racers, one draw: the smallest attainable p is 1/C(3,1) = 1/3 > alpha/3.
    # Even both follow-ups flipping cannot FAIL, so neither can passing mean anything: UNKNOWN, never PASS.
    for toks in ({}, {"follow-0": FLIPPED, "follow-1": FLIPPED}):
        finding = divergence(repeated(1, toks=toks))
        assert_unknown(finding, errors.InsufficientPower)
        assert (finding.figures["n_subject"], finding.figures["n_yardstick"]) == (FOLLOWUPS, 1)
        need = finding.figures["conversations_needed"]
        assert isinstance(need, int) and need > 1
        assert f"run about {need} race rounds" in finding.hint
        assert "cannot reach p < " in finding.reason
    # the run length it names does have the power: at its yield, `need` rounds can fail
    assert divergence(repeated(need)).status is Status.PASS


# --- race_divergence: noise mode ----------------------------------------------------------------------------
# Some cold racer differs from recomputation: the yardstick is the racers' chunking noise, and the count test
# counts confident token flips (`counted == "hard"`).


def test_followups_deviating_beyond_the_cold_racers_noise_are_corruption() -> None:
    finding = divergence(deviating_race(COLD, FAR))
    assert_corruption(finding)
    figures = finding.figures
    assert (figures["mode"], figures["counted"]) == ("noise", "hard")
    assert (figures["n_yardstick"], figures["n_subject"]) == (12, 24)
    assert (figures["yardstick_identical"], figures["subject_identical"]) == (0, 0)
    assert figures["alpha_per_test"] == pytest.approx(GRADING.alpha / 3)
    assert figures["p_values"]["deviation shift"] < figures["alpha_per_test"]
    assert figures["p_values"]["deviations beyond the yardstick"] == pytest.approx(1 / math.comb(36, 12))
    assert figures["p_values"]["count"] == 1.0
    assert listed(finding) == followup_ids(range(24))
    assert figures["yardstick_deviation"]["max_finite"] == pytest.approx(0.06)
    assert figures["subject_deviation"]["max_finite"] == pytest.approx(0.6)
    assert "0/24 flip a confident token vs 0/12" in finding.reason


def test_followups_within_the_cold_racers_noise_pass() -> None:
    finding = divergence(deviating_race(COLD, NEAR))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["mode"] == "noise"
    assert min(finding.figures["p_values"].values()) >= finding.figures["alpha_per_test"]
    assert finding.figures["mismatches"] == []
    assert "24 follow-ups resumed from race-written blocks within the cold racers' 12" in finding.reason
    assert "a deviation beyond 0.075 nat (1.25x their largest) in >= " in finding.reason  # racers top at 0.06
    assert "would have been detected with probability 0.95" in finding.reason
    assert finding.figures["detectable_deviation"] == pytest.approx(1.25 * 0.06)


def test_followups_at_the_cold_racers_level_pass() -> None:
    # Same distribution, round for round: no tendency to exceed it.
    finding = divergence(deviating_race(COLD, COLD))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["p_values"]["deviation shift"] > 0.1


# Follow-ups all above the bulk of the racers' noise, none beyond its largest: only the rank test sees them.
# Below its 4th largest too (0.05), where the exceedance test's deepest threshold lies.
BULK = (*(0.01 + 0.01 * i / 7 for i in range(8)), 0.05, 0.053, 0.056, 0.06)  # 0.01 .. 0.02, and four above
HIGH = tuple(0.03 + 0.005 * i / 23 for i in range(24))  # 0.03 .. 0.035


def test_each_test_runs_at_a_third_of_alpha() -> None:
    history = deviating_race(BULK, HIGH)
    p = divergence(history).figures["p_values"]
    assert p["deviations beyond the yardstick"] == p["count"] == 1.0
    shift = p["deviation shift"]
    assert divergence(history, alpha=3.1 * shift).status is Status.FAIL
    strict = divergence(history, alpha=2.9 * shift)
    assert strict.status is Status.PASS, strict.reason
    assert strict.figures["alpha_per_test"] == pytest.approx(2.9 * shift / 3)


# 12 rounds of cold racers (0.01 .. 0.06) and of 2 follow-ups: 12 confident flips, the rest identical. The flips
# rank above every racer but the identical twelve below them all, so ranks alone see nothing.
FISHER_HITS: tuple[Answer, ...] = (*(FLIPPED,) * 12, *(0.0,) * 12)


def test_the_racers_of_a_round_are_one_draw_however_they_answer() -> None:
    # Every racer of a round is compared with the round's one recomputation, so a recomputation that lands off
    # puts them all high together. 6 rounds of 8 racers at 0.01 .. 0.06 (one level a round, each racer its own
    # answer) and 18 follow-ups, 6 of them just beyond every racer: as 48 draws, 6 of 18 beyond the largest of 48
    # would be a FAIL; as the 6 draws they are, it is ordinary (p > 0.1).
    hits = (*(0.07,) * 6, *(0.005,) * 12)
    exchanges: list[Exchange] = []
    for i in range(6):
        toks = {f"race-{j}": shifted(0.01 * (i + 1) + 1e-6 * j) for j in range(8)}
        toks |= {f"follow-{f}": shifted(hits[3 * i + f]) for f in range(3)}
        exchanges += round_exchanges(R0 + i, racers=8, followups=3, toks=toks)
    history = race_history([*exchanges, *liveness_pair()], [rnd(R0 + i, racers=8, followups=3) for i in range(6)])
    finding = divergence(history)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["n_yardstick"] == 6
    assert finding.figures["p_values"]["deviations beyond the yardstick"] > 0.1
    assert finding.figures["yardstick_deviation"]["max_finite"] == pytest.approx(0.06)  # race-0 of each round
    # The draw is the first racer that is comparable and cold, whatever its value: here race-0 hit the cache.
    hit_first = with_rounds(
        history,
        *(
            [
                dataclasses.replace(e, cached_tokens=16) if e.kind == "race-0" else e
                for e in exchanges
                if e.conversation == R0 + i
            ]
            for i in range(6)
        ),
    )
    assert divergence(hit_first).figures["yardstick_deviation"]["max_finite"] == pytest.approx(0.06 + 1e-6)


def test_confident_flips_in_followups_only_are_corruption_through_the_count_test() -> None:
    finding = divergence(deviating_race(COLD, FISHER_HITS))
    assert_corruption(finding)
    p, level = finding.figures["p_values"], finding.figures["alpha_per_test"]
    assert p["deviation shift"] >= level  # the rank test alone would pass this
    assert p["count"] < level
    # a confident flip is an infinite deviation, so it is also beyond every racer; the exceedance test tries the
    # racers' 4 largest as thresholds and pays for that (its single-threshold p is C(24, 12) / C(36, 12))
    single = math.comb(24, 12) / math.comb(36, 12)
    assert p["deviations beyond the yardstick"] == pytest.approx(
        stats.exceedance([math.inf] * 12 + [0.0] * 12, COLD, 4).p_value
    )
    assert single < p["deviations beyond the yardstick"] < 4 * single
    assert finding.figures["counted"] == "hard"
    assert finding.figures["subject_deviation"]["hard"] == 12
    assert finding.figures["yardstick_deviation"]["hard"] == 0
    assert listed(finding) == followup_ids(range(12))
    assert "12/24 flip a confident token vs 0/12" in finding.reason


def test_near_tie_flips_in_followups_are_noise() -> None:
    # The same flips where recomputation hesitated (margin 0.5 < hard_margin 1): no hard divergence.
    near_ties = (*(FLIPPED_TIED,) * 12, *(TIED,) * 12)
    finding = divergence(deviating_race(COLD, near_ties, follow_fresh=TIED))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["subject_deviation"]["hard"] == 0
    # and under a hard margin above ANSWER's 2 nats the confident flips are near-ties too
    relaxed = divergence(deviating_race(COLD, FISHER_HITS), hard_margin=2.5)
    assert relaxed.status is Status.PASS, relaxed.reason


def test_confident_flips_as_frequent_among_cold_racers_are_not_corruption_nor_a_pass() -> None:
    # half the rounds' racers flipping (each round its own answer): the follow-ups' flips are no more frequent,
    # so no FAIL; but the racers' largest deviations are all flips, so no deviation short of one could have shown
    # either, and the run cannot PASS.
    flips = tuple(h.tokens(-0.1, -0.2, -0.3 - 0.001 * i, words=["alpha", "bravo", "three"]) for i in range(6))
    finding = divergence(deviating_race((*flips, *COLD[6:]), FISHER_HITS))
    assert_unknown(finding, errors.InsufficientPower)
    assert finding.figures["yardstick_deviation"]["hard"] == 6
    assert finding.figures["p_values"]["count"] >= finding.figures["alpha_per_test"]


def test_confident_flips_are_corruption_even_when_a_cold_racer_flipped_too() -> None:
    hits: tuple[Answer, ...] = (*(FLIPPED,) * 18, *(0.0,) * 6)
    finding = divergence(deviating_race((FLIPPED, *COLD[1:]), hits))
    assert_corruption(finding)
    assert "18/24 flip a confident token vs 1/12" in finding.reason
    # One racer's flip makes the racers' largest deviation infinite, so nothing lies beyond it; the exceedance
    # test's deeper thresholds (the racers' 2nd to 4th largest) are finite and see the flips, as does the count
    # test. The flipped follow-ups are what the finding lists for replay.
    assert finding.figures["p_values"]["count"] < finding.figures["alpha_per_test"]
    assert finding.figures["p_values"]["deviations beyond the yardstick"] < finding.figures["alpha_per_test"]
    assert finding.figures["exceedance_rank"] > 1
    assert sorted(listed(finding)) == sorted(followup_ids(range(18)))


# --- race_divergence: what counts as evidence ---------------------------------------------------------------


@pytest.mark.parametrize("cached", [0, None], ids=["zero", "not-reported"])
def test_followups_that_did_not_hit_are_not_counted(cached: int | None) -> None:
    # follow-0 differs from its recomputation in every round, but resumed from nothing: it says nothing about
    # race-written blocks (counted, its 6 of 12 would be corruption).
    finding = divergence(repeated(6, toks={"follow-0": FLIPPED}, cached={"follow-0": cached}))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["n_subject"] == 6


def test_racers_that_hit_are_not_cold() -> None:
    # race-0 resumed from a block another racer wrote and moved by 0.5: were it calibration, follow-1's 0.3 would
    # sit inside the noise; it is not, so the other racers are exact and follow-1 is corruption.
    toks = {"race-0": shifted(0.5), "follow-1": shifted(0.3)}
    finding = divergence(repeated(EXACT_ROUNDS, toks=toks, cached={"race-0": h.BLOCK}))
    assert_corruption(finding)
    assert finding.figures["mode"] == "exact"
    assert finding.figures["n_yardstick"] == EXACT_ROUNDS  # the other racers, alike: one draw a round
    assert listed(finding) == [(R0 + i, "follow-1") for i in range(EXACT_ROUNDS)]
    assert [m["deviation"] for m in finding.figures["mismatches"]] == pytest.approx([0.3] * EXACT_ROUNDS)


@pytest.mark.parametrize("how", ["no-logprobs", "failed", "missing"])
@pytest.mark.parametrize("kind", ["follow-0", "follow-0-fresh"])
def test_followups_without_a_comparable_pair_are_not_evidence(kind: str, how: str) -> None:
    # follow-0 flips in every round; compared, its 6 of 12 would be corruption.
    toks = {"follow-0": FLIPPED} | ({kind: ()} if how == "no-logprobs" else {})
    history = repeated(
        6, toks=toks, failed=(kind,) if how == "failed" else (), drop=(kind,) if how == "missing" else ()
    )
    finding = divergence(history)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["n_subject"] == 6 * (FOLLOWUPS - 1)


@pytest.mark.parametrize("how", ["no-logprobs", "failed", "missing"])
def test_racers_without_a_comparable_pair_are_not_calibration(how: str) -> None:
    # race-1 would put the race in noise mode (and so let follow-0's 1e-7 pass) if it were compared.
    toks = {"race-1": shifted(0.5) if how != "no-logprobs" else (), "follow-0": shifted(1e-7)}
    history = repeated(
        EXACT_ROUNDS,
        toks=toks,
        failed=("race-1",) if how == "failed" else (),
        drop=("race-1",) if how == "missing" else (),
    )
    finding = divergence(history)
    assert_corruption(finding)
    assert finding.figures["n_yardstick"] == EXACT_ROUNDS


@pytest.mark.parametrize("how", ["no-logprobs", "failed", "missing"])
def test_a_round_without_its_recomputation_calibrates_nothing(how: str) -> None:
    follow = {"follow-0": shifted(1e-7)}
    toks = follow | {"race-1": shifted(0.5)} | ({"race-fresh": ()} if how == "no-logprobs" else {})
    first = round_exchanges(
        R0,
        toks=toks,
        failed=("race-fresh",) if how == "failed" else (),
        drop=("race-fresh",) if how == "missing" else (),
    )
    n = EXACT_ROUNDS + 1
    rest = (round_exchanges(R0 + i, toks=follow) for i in range(1, n))
    finding = divergence(with_rounds(repeated(n), first, *rest))
    assert_corruption(finding)  # round R0's racers are not compared, so the other rounds' exact racers set the mode
    assert finding.figures["n_yardstick"] == n - 1
    assert finding.figures["n_subject"] == n * FOLLOWUPS


def test_no_rounds_is_no_evidence() -> None:
    finding = divergence(race_history(round_exchanges(R0, toks={"follow-0": FLIPPED}), []))
    assert_unknown(finding, errors.NoEvidence)
    assert "0 follow-ups resumed from race-written blocks, 0 cold racers" in finding.reason


def test_no_followup_hits_is_no_evidence() -> None:
    finding = divergence(repeated(2, toks={"follow-1": FLIPPED}, cached=uncached_followups()))
    assert_unknown(finding, errors.NoEvidence)
    assert "0 follow-ups resumed from race-written blocks, 2 cold racers" in finding.reason  # one answer a round


def test_no_cold_racers_is_no_evidence() -> None:
    cached = {f"race-{j}": h.BLOCK for j in range(RACERS)}
    finding = divergence(repeated(6, toks={"follow-1": FLIPPED}, cached=cached))
    assert_unknown(finding, errors.NoEvidence)
    assert f"{6 * FOLLOWUPS} follow-ups resumed from race-written blocks, 0 cold racers" in finding.reason


def test_answers_without_logprobs_are_no_evidence() -> None:
    toks: dict[str, Sequence[TokenLogprob]] = {kind: () for kind in kinds()}
    finding = divergence(repeated(6, toks=toks))
    assert_unknown(finding, errors.NoEvidence)
    assert "0 follow-ups resumed from race-written blocks, 0 cold racers" in finding.reason


def test_distinct_outputs_count_racer_answers_and_followups_that_read_differently() -> None:
    exchanges = round_exchanges(R0)
    texts = {"race-1": "alpha bravo three", "race-3": "alpha bravo three", "follow-1": "zulu"}
    exchanges = [dataclasses.replace(e, text=texts.get(e.kind, e.text)) for e in exchanges]
    history = with_rounds(healthy_race(1), exchanges)
    figures = divergence(history).figures["distinct_outputs"]
    assert figures == {R0: {"racer_answers": 2, "followups_differing": 1}}


# --- largest_step -------------------------------------------------------------------------------------------


def test_no_window_has_no_largest_step() -> None:
    assert race.largest_step(None) is None


def test_steps_of_at_most_256_tokens_give_256() -> None:
    # EARLIER holds a 2000-token step: only the window's own steps count.
    assert race.largest_step(window(256, 200, 64, 1)) == 256


def test_one_step_in_the_512_bucket_gives_512() -> None:
    assert race.largest_step(window(512, 100, 8)) == 512
    assert race.largest_step(window(257, 100, 8)) == 512


def test_a_step_above_every_finite_bucket_gives_infinity() -> None:
    assert race.largest_step(window(5000, 16)) == INF


def test_steps_of_every_engine_count() -> None:
    before = MetricsDelta(metrics.parse(iteration_text([], [])), metrics.parse(iteration_text([64, 32], [1000])))
    assert race.largest_step(before) == 1024


def test_no_histogram_has_no_largest_step() -> None:
    assert race.largest_step(h.live_delta()) is None


@pytest.mark.parametrize("earlier", [(), EARLIER], ids=["never-counted", "counted-before-the-window"])
def test_an_empty_histogram_has_no_largest_step(earlier: Sequence[int]) -> None:
    # No step was counted in the window: the step size is unknown, not the smallest bucket's bound.
    assert race.largest_step(window(before=earlier)) is None


def test_an_empty_histogram_does_not_prove_fragmentation() -> None:
    assert_unknown(fragmentation(healthy_race(race_window=window())), errors.TriggerNotExercised)


# --- fragmentation ------------------------------------------------------------------------------------------


def test_fragmented_rounds_whose_followups_resumed_pass() -> None:
    finding = fragmentation(healthy_race(2))
    assert finding.status is Status.PASS, finding.reason
    assert finding.check == "race-trigger"
    assert finding.figures["largest_step_tokens"] == 128
    assert finding.figures["stated_budget"] is None
    # the racers' cold tokens only: neither the follow-ups nor the recomputations count
    assert finding.figures["round_computed_tokens"] == {R0: RACERS * PROMPT, R0 + 1: RACERS * PROMPT}
    assert finding.figures["rounds_resumed"] == [R0, R0 + 1]
    assert "2 of 2 rounds" in finding.reason


@pytest.mark.parametrize("how", ["zero", "not-reported", "failed", "missing"])
def test_fragmented_rounds_whose_followups_did_not_resume_are_trigger_not_exercised(how: str) -> None:
    follow = [f"follow-{f}" for f in range(FOLLOWUPS)]
    cached = {k: 0 if how == "zero" else None for k in follow} if how in ("zero", "not-reported") else None
    rounds = [
        round_exchanges(
            R0 + i, cached=cached, failed=follow if how == "failed" else (), drop=follow if how == "missing" else ()
        )
        for i in range(2)
    ]
    finding = fragmentation(with_rounds(healthy_race(2), *rounds))
    assert_unknown(finding, errors.TriggerNotExercised)
    assert finding.figures["rounds_resumed"] == []
    assert finding.figures["round_computed_tokens"] == {R0: RACERS * PROMPT, R0 + 1: RACERS * PROMPT}
    assert "no follow-up resumed from a block written by a fragmented race round" in finding.reason
    assert "--racers" in finding.hint


def test_followups_resuming_only_in_a_round_that_was_not_split_are_trigger_not_exercised() -> None:
    whole = round_exchanges(R0, prompt=16)  # 64 cold tokens: one step; its follow-ups resumed
    split = round_exchanges(R0 + 1, cached=uncached_followups())  # 160: split; its follow-ups did not resume
    finding = fragmentation(with_rounds(healthy_race(2), whole, split))
    assert_unknown(finding, errors.TriggerNotExercised)
    assert finding.figures["rounds_resumed"] == [R0]
    assert f"fragmented [{R0 + 1}], resumed [{R0}]" in finding.reason


def test_one_followup_resuming_from_one_fragmented_round_is_enough() -> None:
    resumed = round_exchanges(R0, cached={"follow-0": 0})  # follow-1 alone hit
    idle = round_exchanges(R0 + 1, prompt=16, cached=uncached_followups())
    finding = fragmentation(with_rounds(healthy_race(2), resumed, idle))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["rounds_resumed"] == [R0]
    assert finding.figures["round_computed_tokens"] == {R0: 160, R0 + 1: 64}
    assert "1 of 2 rounds" in finding.reason


def test_rounds_computing_less_than_the_largest_step_are_trigger_not_exercised() -> None:
    finding = fragmentation(healthy_race(2, race_window=window(256, 8)))
    assert_unknown(finding, errors.TriggerNotExercised)
    assert "(256)" in finding.reason
    assert "prefills were not split" in finding.reason
    assert "--max-num-batched-tokens" in finding.hint
    assert "cpu-tiny-fragmented" in finding.hint
    assert finding.figures["rounds_resumed"] == [R0, R0 + 1]  # resumed, but from blocks of whole prefills


def test_a_round_that_fits_one_step_exactly_was_not_split() -> None:
    history = healthy_race(1, race_window=window(128, 128))
    assert fragmentation(history).figures["round_computed_tokens"] == {R0: 160}
    exact = with_rounds(history, round_exchanges(R0, prompt=32))
    finding = fragmentation(exact)
    assert finding.figures["round_computed_tokens"] == {R0: 128}
    assert_unknown(finding, errors.TriggerNotExercised)


def test_cached_racer_tokens_are_not_computed() -> None:
    cached = {"race-1": 32, "race-2": 32, "race-3": 32}
    finding = fragmentation(with_rounds(healthy_race(1), round_exchanges(R0, cached=cached)))
    assert finding.figures["round_computed_tokens"] == {R0: PROMPT + 3 * (PROMPT - 32)}
    assert_unknown(finding, errors.TriggerNotExercised)


def test_failed_racers_computed_nothing() -> None:
    exchanges = [  # a failed answer's usage, should one come back, is not the server's work either
        dataclasses.replace(e, prompt_tokens=PROMPT) for e in round_exchanges(R0, failed=("race-0", "race-1"))
    ]
    finding = fragmentation(with_rounds(healthy_race(1), exchanges))
    assert finding.figures["round_computed_tokens"] == {R0: 2 * PROMPT}
    assert_unknown(finding, errors.TriggerNotExercised)


@pytest.mark.parametrize("race_window", [None, h.live_delta()], ids=["no-window", "no-histogram"])
def test_no_histogram_and_no_stated_budget_is_trigger_not_exercised(race_window: MetricsDelta | None) -> None:
    finding = fragmentation(healthy_race(2, race_window=race_window))
    assert_unknown(finding, errors.TriggerNotExercised)
    assert "no vllm:iteration_tokens_total histogram" in finding.reason
    assert "--max-num-batched-tokens" in finding.hint
    assert finding.figures["largest_step_tokens"] is None


def test_a_stated_budget_stands_in_for_a_missing_histogram() -> None:
    finding = fragmentation(healthy_race(2, race_window=None, step_budget=64))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["largest_step_tokens"] == 64
    assert finding.figures["stated_budget"] == 64


def test_a_stated_budget_overrides_the_histogram() -> None:
    # The histogram alone says 256 (not split); the stated budget of 128 says split.
    split = fragmentation(healthy_race(2, race_window=window(256), step_budget=128))
    assert split.status is Status.PASS, split.reason
    assert split.figures["largest_step_tokens"] == 128
    # The histogram alone says 128 (split); the stated budget of 256 says not.
    whole = fragmentation(healthy_race(2, race_window=window(128), step_budget=256))
    assert_unknown(whole, errors.TriggerNotExercised)
    assert whole.figures["largest_step_tokens"] == 256


# --- liveness -----------------------------------------------------------------------------------------------


def test_a_second_send_that_hits_is_live() -> None:
    finding = race.liveness(healthy_race())
    assert finding.status is Status.PASS, finding.reason
    assert finding.check == "race-liveness"
    assert finding.figures["cached_tokens"] == 48


@pytest.mark.parametrize(
    "pair",
    [liveness_pair(0), liveness_pair(None), liveness_pair(48, error="HTTP 500"), liveness_pair(48)[:1]],
    ids=["zero", "none", "failed", "missing"],
)
def test_a_second_send_that_does_not_hit_is_cache_not_live(pair: list[Exchange]) -> None:
    history = healthy_race()
    history = dataclasses.replace(
        history, exchanges=(*(e for e in history.exchanges if "liveness" not in e.kind), *pair)
    )
    finding = race.liveness(history)
    assert_unknown(finding, errors.CacheNotLive)
    assert "did not hit the cache" in finding.reason
    assert "--enable-prompt-tokens-details" in finding.hint


def test_only_the_second_send_counts() -> None:
    pair = [
        h.exchange(race.LIVENESS, Arm.TREATMENT, "liveness-1", cached=48),
        h.exchange(race.LIVENESS, Arm.TREATMENT, "liveness-2", cached=0),
    ]
    assert_unknown(race.liveness(race_history(pair, [])), errors.CacheNotLive)


def test_race_followups_that_hit_do_not_make_the_cache_live() -> None:
    # the race's own hits are what is under test; liveness is proved by its own pair alone
    history = healthy_race()
    history = dataclasses.replace(history, exchanges=tuple(e for e in history.exchanges if "liveness" not in e.kind))
    assert any(e.cached_tokens for e in history.exchanges)
    assert_unknown(race.liveness(history), errors.CacheNotLive)


# --- probes pick gates and graders --------------------------------------------------------------------------


def checks(found: Sequence[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in found}


def combined(conversations: int = 10, rounds: int = 6) -> History:
    """A healthy multiturn run and a healthy cold race on one treatment, each large enough for its grader to have
    power with four graders sharing alpha (recall: 10 rows, 2^-10 < 0.01/4; race: 12 follow-ups against 6 racer
    draws, 1/C(18, 6) < 0.01/12)."""
    base, raced = h.healthy(conversations), healthy_race(rounds)
    return dataclasses.replace(
        base, exchanges=(*base.exchanges, *raced.exchanges), races=raced.races, race_window=raced.race_window
    )


def test_the_cold_race_probe_runs_the_race_gates_and_not_the_multiturn_ones() -> None:
    history = healthy_race(6)
    found = gates.all_gates(history, GRADING, probes=("cold-race",))
    assert [f.check for f in found] == RACE_GATES
    assert all(f.status is Status.PASS for f in found), {f.check: f.reason for f in found}
    # gates alone never PASS a run (no grader judged anything); with the race grader's PASS they do
    assert merge(found).exit_code == 2
    assert merge([*found, *graders.grade(history, GRADING, probes=("cold-race",)).findings]).exit_code == 0
    # the same history would fail the multiturn gates (no conversations, no drafter), so they really were skipped
    multiturn = checks(gates.all_gates(history, GRADING))
    assert list(multiturn) == MULTITURN_GATES
    assert multiturn["trigger"].status is Status.UNKNOWN
    assert multiturn["drafter-live"].error_class == "SpecDecodeNotEngaged"


@pytest.mark.parametrize(
    ("history", "check", "error"),
    [
        (healthy_race(2, step_budget=4096), "race-trigger", errors.TriggerNotExercised),
        (
            with_rounds(healthy_race(1), round_exchanges(R0, cached=uncached_followups())),
            "race-trigger",
            errors.TriggerNotExercised,
        ),
        (race_history(round_exchanges(R0), [rnd(R0)], race_window=window(64)), "race-liveness", errors.CacheNotLive),
    ],
    ids=["not-fragmented", "not-resumed", "no-liveness-hit"],
)
def test_a_failed_race_gate_makes_the_run_unknown(
    history: History, check: str, error: type[errors.Inconclusive]
) -> None:
    found = checks(gates.all_gates(history, GRADING, probes=("cold-race",)))
    assert {n for n, f in found.items() if f.status is not Status.PASS} == {check}
    verdict = merge(found.values())
    assert verdict.status is Status.UNKNOWN
    assert verdict.error_class == error.__name__


def test_both_probes_run_both_sets_of_gates() -> None:
    found = gates.all_gates(combined(), GRADING, probes=("multiturn", "cold-race"))
    assert [f.check for f in found] == [*MULTITURN_GATES, "race-trigger", "race-liveness"]
    assert all(f.status is Status.PASS for f in found), {f.check: f.reason for f in found}
    # the multiturn probe alone leaves the race gates out
    assert [f.check for f in gates.all_gates(combined(), GRADING)] == MULTITURN_GATES


def corrupt_multiturn(history: History) -> History:
    """Every cache-hit turn-2 answer lost the needle while its no-reuse twin and the control kept it: forward flips
    in every conversation, so the recall grader FAILs. (Exactness needs a reference now, so it cannot serve.)"""
    exchanges = tuple(
        dataclasses.replace(e, text="zulu zulu zulu") if (e.arm, e.kind) == (Arm.TREATMENT, Kind.TURN2) else e
        for e in history.exchanges
    )
    return dataclasses.replace(history, exchanges=exchanges)


@pytest.mark.parametrize("grading", [GRADING, Grading(graders=("recall",))], ids=["auto", "named"])
def test_the_cold_race_probe_grades_with_race_divergence_only(grading: Grading) -> None:
    history = corrupt_multiturn(combined())
    assert graders.recall(history, GRADING).status is Status.FAIL  # would FAIL if it ran
    grades = graders.grade(history, grading, probes=("cold-race",))
    assert grades.used == ("race-divergence",)
    assert [f.check for f in grades.findings] == ["race-divergence"]
    assert grades.findings[0].status is Status.PASS
    assert grades.not_used == ()
    assert grades.alpha_per_grader == GRADING.alpha  # the one grader used gets all of alpha


def test_the_cold_race_probe_reports_race_corruption() -> None:
    history = repeated(6, toks={f"follow-{f}": shifted(0.01) for f in range(FOLLOWUPS)})
    grades = graders.grade(history, GRADING, probes=("cold-race",))
    [finding] = grades.findings
    assert (finding.error_class, finding.stage, finding.covers_trigger) == ("CorruptionDetected", "grader", True)
    found = gates.all_gates(history, GRADING, probes=("cold-race",))
    assert merge([*found, *grades.findings]).status is Status.FAIL
    # the same FAIL on a run whose race gate failed is not evidence: the gate decides
    unsplit = gates.all_gates(dataclasses.replace(history, step_budget=4096), GRADING, probes=("cold-race",))
    verdict = merge([*unsplit, *grades.findings])
    assert (verdict.status, verdict.error_class) == (Status.UNKNOWN, "TriggerNotExercised")


def test_the_cold_race_probe_grades_with_the_stated_alpha_and_hard_margin() -> None:
    high = deviating_race(BULK, HIGH)  # only the rank test sees these follow-ups
    shift = divergence(high).figures["p_values"]["deviation shift"]

    def grade(history: History, grading: Grading) -> Finding:
        [finding] = graders.grade(history, grading, probes=("cold-race",)).findings
        return finding

    assert grade(high, Grading(alpha=3.1 * shift)).status is Status.FAIL
    passed = grade(high, Grading(alpha=2.9 * shift))
    assert passed.status is Status.PASS, passed.reason
    assert passed.figures["alpha"] == pytest.approx(2.9 * shift)
    # an alpha so small that 24 follow-ups against 12 racer draws cannot reach it: no power, whatever they show
    far = deviating_race(COLD, FAR)
    assert grade(far, GRADING).status is Status.FAIL
    assert grade(far, Grading(alpha=2.9 / math.comb(36, 12))).error_class == "InsufficientPower"
    flips = deviating_race(COLD, FISHER_HITS)
    assert grade(flips, GRADING).status is Status.FAIL
    relaxed = grade(flips, Grading(hard_margin=2.5))
    assert relaxed.status is Status.PASS, relaxed.reason


def test_a_cold_race_without_rounds_is_never_graded_pass() -> None:
    grades = graders.grade(race_history(liveness_pair(), []), GRADING, probes=("cold-race",))
    assert grades.used == ()  # no evidence: not used, but kept, since the probe asked for it
    assert grades.alpha_per_grader is None
    [finding] = grades.findings
    assert finding.error_class == "NoEvidence"
    assert merge(grades.findings).status is Status.UNKNOWN


def test_both_probes_grade_with_both_sets() -> None:
    grades = graders.grade(combined(), GRADING, probes=("multiturn", "cold-race"))
    # no reference: exactness and logprob have nothing, so alpha is split over recall and race-divergence
    assert set(grades.used) == {"recall", "race-divergence"}
    assert {g for g, _ in grades.not_used} == {"exactness", "logprob"}
    assert grades.alpha_per_grader == pytest.approx(GRADING.alpha / 2)
    assert all(f.status is Status.PASS for f in grades.findings), {f.check: f.reason for f in grades.findings}
    assert merge(grades.findings).status is Status.PASS
    # a multiturn corruption shows through the race's PASS
    found = checks(graders.grade(corrupt_multiturn(combined()), GRADING, probes=("multiturn", "cold-race")).findings)
    assert found["race-divergence"].status is Status.PASS
    assert found["recall"].status is Status.FAIL
    # and the multiturn probe alone leaves race-divergence out
    assert "race-divergence" not in graders.grade(combined(), GRADING).used
