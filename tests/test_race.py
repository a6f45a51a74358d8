"""The cold-race probe's checkers on hand-built histories: exactness against recomputation, the fragmentation and
liveness gates, the step size read from `vllm:iteration_tokens_total`, and how `--probe` picks gates and graders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest

from blackbox import errors, gates, graders, metrics, race
from blackbox.config import Grading
from blackbox.history import Arm, Exchange, History, Kind, TokenLogprob
from blackbox.metrics import MetricsDelta
from blackbox.race import RaceRound
from blackbox.verdict import Finding, Status, merge

import histories as h

GRADING = Grading()
R0 = race.FIRST_ROUND
RACERS = 4
PROMPT = 40  # 2.5 blocks of 16: every racer's prompt
REHIT_CACHED = 2 * h.BLOCK
ANSWER = h.tokens(-0.1, -0.2, -0.3, words=["alpha", "bravo", "two"])
BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # vLLM's iteration_tokens buckets, trimmed
EARLIER = (2000, 700, 40, 1)  # steps taken before the race window opened (the multiturn probe, warm-up)
RACE_GATES = ["endpoints", "counters", "cache-live", "race-trigger", "race-liveness"]
MULTITURN_GATES = ["endpoints", "counters", "cache-live", "trigger", "drafter-live"]

# A treatment whose cache hits but which has no drafter: the multiturn drafter gate would fail on it.
NO_DRAFTER = h.live_delta(DRAFTS=None, DRAFT_TOKENS=None, ACCEPTED=None, ACCEPTED_PER_POS=None)


# --- builders -----------------------------------------------------------------------------------------------


def kinds(racers: int = RACERS) -> list[str]:
    return [*(f"race-{j}" for j in range(racers)), "race-rehit", "race-fresh"]


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
    prompt: int = PROMPT,
    toks: Mapping[str, Sequence[TokenLogprob]] | None = None,
    cached: Mapping[str, int | None] | None = None,
    failed: Sequence[str] = (),
    drop: Sequence[str] = (),
) -> list[Exchange]:
    """The racers, the re-hit and the recomputation of one round, all answering ANSWER; `toks` and `cached` map a
    kind to its own tokens or cached_tokens, `failed` kinds carry an error, `drop` kinds were never recorded."""
    toks, cached = toks or {}, cached or {}
    out = []
    for kind in kinds(racers):
        if kind in drop:
            continue
        default_cached = REHIT_CACHED if kind == "race-rehit" else 0
        out.append(
            answer(
                index,
                kind,
                toks.get(kind, ANSWER),
                prompt=prompt,
                cached=cached.get(kind, default_cached),
                error="HTTP 500: engine error" if kind in failed else None,
            )
        )
    return out


def rnd(index: int, *, racers: int = RACERS, prompt: int = PROMPT) -> RaceRound:
    return RaceRound(index, 2.5, prompt, racers)


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
    """n clean rounds of RACERS x PROMPT = 160 cold tokens, steps of at most 128 tokens, and a live cache."""
    exchanges = [e for i in range(n) for e in round_exchanges(R0 + i)]
    fields: dict[str, object] = {"race_window": window(128, 128, 32, 16, 8)}
    fields.update(changes)
    history = race_history([*exchanges, *liveness_pair()], [rnd(R0 + i) for i in range(n)])
    return dataclasses.replace(history, **fields)


def exactness(history: History) -> Finding:
    return race.race_exactness(history, history.races)


def fragmentation(history: History) -> Finding:
    return race.fragmentation(history, history.races, history.race_window, history.step_budget)


def assert_unknown(finding: Finding, error: type[errors.BlackboxError]) -> None:
    assert finding.status is Status.UNKNOWN, finding.reason
    assert finding.error_class == error.__name__
    assert merge([finding]).exit_code == error.exit_code


# --- race_exactness -----------------------------------------------------------------------------------------


def test_racers_and_rehit_identical_to_recomputation_pass() -> None:
    finding = exactness(healthy_race(3))
    assert finding.status is Status.PASS, finding.reason
    assert finding.check == "race-exactness"
    assert finding.figures["distinct_outputs_per_round"] == [1, 1, 1]
    assert finding.figures["checked"] == 3 * (RACERS + 1)
    assert finding.figures["mismatches"] == []
    assert merge([finding]).exit_code == 0


@pytest.mark.parametrize(
    "toks",
    [
        h.tokens(-0.1, -0.2000001, -0.3, words=["alpha", "bravo", "two"]),  # the chosen token's logprob
        h.tokens(-0.1, -0.2, -0.3, words=["alpha", "bravo", "two"], margin=2.0001),  # an alternative's logprob
    ],
    ids=["chosen-logprob", "top-logprob"],
)
def test_one_racer_with_one_logprob_differing_is_corruption(toks: tuple[TokenLogprob, ...]) -> None:
    history = healthy_race(2)
    bad = round_exchanges(R0 + 1, toks={"race-2": toks}, cached={"race-2": 16})
    history = dataclasses.replace(history, exchanges=(*round_exchanges(R0), *bad, *liveness_pair()))
    finding = exactness(history)
    assert finding.status is Status.FAIL
    assert finding.error_class == "CorruptionDetected"
    assert f"rounds [{R0 + 1}]" in finding.reason
    assert "1 of 10" in finding.reason
    assert finding.figures["mismatches"] == [{"round": R0 + 1, "kind": "race-2", "cached_tokens": 16}]
    assert finding.figures["distinct_outputs_per_round"] == [1, 1]  # same tokens, so one distinct output
    assert merge([finding]).exit_code == errors.CorruptionDetected.exit_code


def test_a_logprob_differing_without_alternatives_listed_is_corruption() -> None:
    bare = tuple(TokenLogprob(t.token, t.logprob) for t in ANSWER)  # top_logprobs not returned
    other = (bare[0], TokenLogprob("bravo", -0.2000001), bare[2])
    toks = {kind: bare for kind in kinds()} | {"race-1": other}
    finding = exactness(race_history(round_exchanges(R0, toks=toks), [rnd(R0)]))
    assert finding.status is Status.FAIL
    assert [m["kind"] for m in finding.figures["mismatches"]] == ["race-1"]


def test_a_racer_with_a_different_token_is_corruption_and_a_second_distinct_output() -> None:
    other = h.tokens(-0.1, -0.2, -0.3, words=["alpha", "bravo", "three"])
    exchanges = [*round_exchanges(R0), *round_exchanges(R0 + 1, toks={"race-0": other})]
    finding = exactness(race_history(exchanges, [rnd(R0), rnd(R0 + 1)]))
    assert finding.status is Status.FAIL
    assert finding.error_class == "CorruptionDetected"
    assert f"rounds [{R0 + 1}]" in finding.reason
    assert finding.figures["distinct_outputs_per_round"] == [1, 2]
    assert [m["kind"] for m in finding.figures["mismatches"]] == ["race-0"]


def test_a_rehit_differing_from_recomputation_is_corruption() -> None:
    other = h.tokens(-0.1, -0.2, words=["alpha", "bravo"])  # also shorter
    finding = exactness(race_history(round_exchanges(R0, toks={"race-rehit": other}), [rnd(R0)]))
    assert finding.status is Status.FAIL
    assert finding.figures["mismatches"] == [{"round": R0, "kind": "race-rehit", "cached_tokens": REHIT_CACHED}]
    assert finding.figures["distinct_outputs_per_round"] == [2]


def test_racers_agreeing_with_each_other_but_not_with_recomputation_are_corruption() -> None:
    fresh = h.tokens(-0.1, -0.2, -0.3, words=["alpha", "charlie", "two"])
    finding = exactness(race_history(round_exchanges(R0, toks={"race-fresh": fresh}), [rnd(R0)]))
    assert finding.status is Status.FAIL
    assert finding.figures["distinct_outputs_per_round"] == [1]
    assert len(finding.figures["mismatches"]) == RACERS + 1


def test_no_rounds_is_no_evidence() -> None:
    history = race_history(round_exchanges(R0), [])  # answers recorded, but no round says where to look
    finding = exactness(history)
    assert_unknown(finding, errors.NoEvidence)
    assert "no cold-race round ran" in finding.reason


@pytest.mark.parametrize("how", ["missing", "failed"])
def test_rounds_without_a_recomputation_are_no_evidence(how: str) -> None:
    other = h.tokens(-9.0, words=["zulu"])
    exchanges = [
        e
        for i in range(2)
        for e in round_exchanges(
            R0 + i,
            toks={"race-1": other},  # would be corruption if anything were compared
            drop=("race-fresh",) if how == "missing" else (),
            failed=("race-fresh",) if how == "failed" else (),
        )
    ]
    finding = exactness(race_history(exchanges, [rnd(R0), rnd(R0 + 1)]))
    assert_unknown(finding, errors.NoEvidence)
    assert "no race round has a recomputation" in finding.reason


def test_a_round_without_a_recomputation_is_skipped_and_the_others_judged() -> None:
    other = h.tokens(-9.0, words=["zulu"])
    exchanges = [*round_exchanges(R0, toks={"race-1": other}, drop=("race-fresh",)), *round_exchanges(R0 + 1)]
    finding = exactness(race_history(exchanges, [rnd(R0), rnd(R0 + 1)]))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["checked"] == RACERS + 1
    assert finding.figures["distinct_outputs_per_round"] == [1]


def test_failed_exchanges_are_not_compared() -> None:
    other = h.tokens(-9.0, words=["zulu"])
    exchanges = round_exchanges(
        R0, toks={"race-3": other, "race-rehit": other}, failed=("race-3", "race-rehit"), drop=("race-1",)
    )
    finding = exactness(race_history(exchanges, [rnd(R0)]))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["checked"] == RACERS - 2  # race-0 and race-2
    assert finding.figures["distinct_outputs_per_round"] == [1]


def test_a_round_whose_every_answer_failed_is_no_evidence() -> None:
    exchanges = round_exchanges(R0, failed=[k for k in kinds() if k != "race-fresh"])
    assert_unknown(exactness(race_history(exchanges, [rnd(R0)])), errors.NoEvidence)


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
    assert race.largest_step(window(5000, 16)) == float("inf")


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


def test_rounds_computing_more_than_the_largest_step_pass() -> None:
    finding = fragmentation(healthy_race(2))
    assert finding.status is Status.PASS, finding.reason
    assert finding.check == "race-trigger"
    assert finding.figures["largest_step_tokens"] == 128
    assert finding.figures["stated_budget"] is None
    # the racers' cold tokens only: neither the re-hit nor the recomputation counts
    assert finding.figures["round_computed_tokens"] == {R0: RACERS * PROMPT, R0 + 1: RACERS * PROMPT}
    assert "2 of 2 rounds" in finding.reason


def test_rounds_computing_less_than_the_largest_step_are_trigger_not_exercised() -> None:
    finding = fragmentation(healthy_race(2, race_window=window(256, 8)))
    assert_unknown(finding, errors.TriggerNotExercised)
    assert "(256)" in finding.reason
    assert "--max-num-batched-tokens" in finding.hint
    assert "cpu-tiny-fragmented" in finding.hint


def test_a_round_that_fits_one_step_exactly_was_not_split() -> None:
    history = healthy_race(1, race_window=window(128, 128))
    assert fragmentation(history).figures["round_computed_tokens"] == {R0: 160}
    exact = dataclasses.replace(history, exchanges=tuple(round_exchanges(R0, prompt=32)))
    finding = fragmentation(exact)
    assert finding.figures["round_computed_tokens"] == {R0: 128}
    assert_unknown(finding, errors.TriggerNotExercised)


def test_cached_racer_tokens_are_not_computed() -> None:
    cached = {"race-1": 32, "race-2": 32, "race-3": 32}
    history = dataclasses.replace(healthy_race(1), exchanges=tuple(round_exchanges(R0, cached=cached)))
    finding = fragmentation(history)
    assert finding.figures["round_computed_tokens"] == {R0: PROMPT + 3 * (PROMPT - 32)}
    assert_unknown(finding, errors.TriggerNotExercised)


def test_failed_racers_computed_nothing() -> None:
    exchanges = [  # a failed answer's usage, should one come back, is not the server's work either
        dataclasses.replace(e, prompt_tokens=PROMPT) for e in round_exchanges(R0, failed=("race-0", "race-1"))
    ]
    history = dataclasses.replace(healthy_race(1), exchanges=tuple(exchanges))
    finding = fragmentation(history)
    assert finding.figures["round_computed_tokens"] == {R0: 2 * PROMPT}
    assert_unknown(finding, errors.TriggerNotExercised)


def test_one_fragmented_round_is_enough() -> None:
    exchanges = [*round_exchanges(R0, prompt=16), *round_exchanges(R0 + 1)]
    finding = fragmentation(healthy_race(2, exchanges=tuple(exchanges)))
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["round_computed_tokens"] == {R0: 64, R0 + 1: 160}
    assert "1 of 2 rounds" in finding.reason


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


# --- probes pick gates and graders --------------------------------------------------------------------------


def checks(found: Sequence[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in found}


def combined() -> History:
    """A healthy multiturn run and a healthy cold race on one treatment."""
    base, raced = h.healthy(), healthy_race(2)
    return dataclasses.replace(
        base, exchanges=(*base.exchanges, *raced.exchanges), races=raced.races, race_window=raced.race_window
    )


def test_the_cold_race_probe_runs_the_race_gates_and_not_the_multiturn_ones() -> None:
    history = healthy_race(2)
    found = gates.all_gates(history, GRADING, probes=("cold-race",))
    assert [f.check for f in found] == RACE_GATES
    assert all(f.status is Status.PASS for f in found), {f.check: f.reason for f in found}
    assert merge(found).exit_code == 0
    # the same history would fail the multiturn gates (no conversations, no drafter), so they really were skipped
    multiturn = checks(gates.all_gates(history, GRADING))
    assert list(multiturn) == MULTITURN_GATES
    assert multiturn["trigger"].status is Status.UNKNOWN
    assert multiturn["drafter-live"].error_class == "SpecDecodeNotEngaged"


@pytest.mark.parametrize(
    ("history", "check", "error"),
    [
        (healthy_race(2, step_budget=4096), "race-trigger", errors.TriggerNotExercised),
        (race_history(round_exchanges(R0), [rnd(R0)], race_window=window(64)), "race-liveness", errors.CacheNotLive),
    ],
    ids=["not-fragmented", "no-liveness-hit"],
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
    """Conversation 0's prefill-region probe differs from its recomputation: the exactness grader FAILs."""
    exchanges = tuple(
        dataclasses.replace(e, tokens=h.tokens(-0.1, -0.25, -0.3))
        if (e.conversation, e.arm, e.kind) == (0, Arm.TREATMENT, Kind.PROBE_FRESH)
        else e
        for e in history.exchanges
    )
    return dataclasses.replace(history, exchanges=exchanges)


@pytest.mark.parametrize("grading", [GRADING, Grading(graders=("exactness",))], ids=["auto", "named"])
def test_the_cold_race_probe_grades_with_race_exactness_only(grading: Grading) -> None:
    history = corrupt_multiturn(combined())
    assert graders.exactness(history, GRADING).status is Status.FAIL  # would FAIL if it ran
    grades = graders.grade(history, grading, probes=("cold-race",))
    assert grades.used == ("race-exactness",)
    assert [f.check for f in grades.findings] == ["race-exactness"]
    assert grades.findings[0].status is Status.PASS
    assert grades.not_used == ()


def test_the_cold_race_probe_reports_race_corruption() -> None:
    other = h.tokens(-0.1, words=["alpha"])
    history = dataclasses.replace(healthy_race(1), exchanges=tuple(round_exchanges(R0, toks={"race-3": other})))
    grades = graders.grade(history, GRADING, probes=("cold-race",))
    assert merge(grades.findings).status is Status.FAIL
    assert grades.findings[0].error_class == "CorruptionDetected"


def test_a_cold_race_without_rounds_is_never_graded_pass() -> None:
    grades = graders.grade(race_history(liveness_pair(), []), GRADING, probes=("cold-race",))
    assert grades.used == ("race-exactness",)
    assert merge(grades.findings).status is Status.UNKNOWN
    assert grades.findings[0].error_class == "NoEvidence"


def test_both_probes_grade_with_both_sets() -> None:
    grades = graders.grade(combined(), GRADING, probes=("multiturn", "cold-race"))
    assert grades.used[0] == "race-exactness"
    assert {"exactness", "recall"} <= set(grades.used)
    assert all(f.status is Status.PASS for f in grades.findings), {f.check: f.reason for f in grades.findings}
    # a multiturn corruption shows through the race's PASS
    found = checks(graders.grade(corrupt_multiturn(combined()), GRADING, probes=("multiturn", "cold-race")).findings)
    assert found["race-exactness"].status is Status.PASS
    assert found["exactness"].status is Status.FAIL
    # and the multiturn probe alone leaves race-exactness out
    assert "race-exactness" not in graders.grade(combined(), GRADING).used
