"""Gates on hand-built histories: every way a run can test nothing is UNKNOWN (or ERROR), never PASS."""

from __future__ import annotations

import dataclasses
import math

import pytest

from blackbox import errors, gates, metrics
from blackbox.config import Grading
from blackbox.history import Arm, Exchange, History, Kind, TokenLogprob
from blackbox.verdict import Finding, Status, merge

import histories as h

GRADING = Grading()


def by_check(history: History) -> dict[str, Finding]:
    return {f.check: f for f in gates.all_gates(history, GRADING)}


def assert_only_failure(history: History, check: str, error: type[errors.BlackboxError]) -> Finding:
    found = by_check(history)
    failing = {name for name, f in found.items() if f.status is not Status.PASS}
    assert failing == {check}, {n: f.reason for n, f in found.items()}
    finding = found[check]
    assert finding.error_class == error.__name__
    verdict = merge(found.values())
    assert verdict.status is not Status.PASS
    assert verdict.exit_code == error.exit_code
    return finding


def test_a_live_run_passes_every_gate() -> None:
    found = by_check(h.healthy())
    assert [f.status for f in found.values()] == [Status.PASS] * 6
    assert found["trigger"].figures["decode_region_hits"] == 4
    assert found["cache-live"].figures["hit_ratio"] == pytest.approx(0.3)
    assert found["drafter-live"].figures["acceptance_per_position"] == {"0": 0.8, "1": 0.6}
    # Gates alone never make a PASS: no grader judged anything yet.
    assert merge(found.values()).error_class == "NoEvidence"


# --- cache-live ---------------------------------------------------------------------------------------------


def test_zero_hits_is_cache_not_live() -> None:
    finding = assert_only_failure(h.healthy(CACHE_HITS=0), "cache-live", errors.CacheNotLive)
    assert finding.status is Status.UNKNOWN
    assert "did not move over 4000" in finding.reason
    assert "--enable-prefix-caching" in finding.hint


def test_zero_hits_under_memory_pressure_says_the_cache_may_be_too_small() -> None:
    history = h.healthy(CACHE_HITS=0)
    pressed = h.live_delta(CACHE_HITS=0, PREEMPTIONS=28, EVICTIONS=2092)
    finding = assert_only_failure(
        dataclasses.replace(history, deltas={**history.deltas, Arm.TREATMENT: pressed}),
        "cache-live",
        errors.CacheNotLive,
    )
    assert "preemptions 28, evictions 2092" in finding.hint and "too small" in finding.hint
    assert finding.figures["preemptions"] == 28 and "--enable-prefix-caching" in finding.hint
    # Without pressure the hint is the flags' alone.
    assert "too small" not in assert_only_failure(history, "cache-live", errors.CacheNotLive).hint


def test_missing_hit_counter_is_cache_not_live() -> None:
    finding = assert_only_failure(h.healthy(CACHE_HITS=None), "cache-live", errors.CacheNotLive)
    assert "no vllm:prefix_cache_hits_total counter" in finding.reason


def test_no_treatment_metrics_at_all_is_cache_not_live() -> None:
    history = dataclasses.replace(h.healthy(), deltas={})
    found = by_check(history)
    assert found["cache-live"].error_class == "CacheNotLive"
    assert found["drafter-live"].error_class == "SpecDecodeNotEngaged"
    assert merge(found.values()).status is Status.UNKNOWN


# --- trigger ------------------------------------------------------------------------------------------------


def test_hits_only_in_the_prompt_region_do_not_exercise_the_trigger() -> None:
    # The default retention: turn 2's hit stops at a prefill checkpoint, below turn 1's prompt length.
    finding = assert_only_failure(h.healthy(turn2_cached=h.PROMPT_HIT), "trigger", errors.TriggerNotExercised)
    assert finding.figures["decode_region_hits"] == 0
    assert "only 0 of 4" in finding.reason
    assert "--prefix-cache-retention-interval" in finding.hint


@pytest.mark.parametrize(
    ("cached", "reaches"),
    [
        (h.PROMPT_HIT, False),
        (h.PROMPT, False),  # the whole prompt, nothing decoded
        # The boundary of the block holding the prompt's end: its checkpoint was written after the first decoded
        # tokens, i.e. during speculative decode, so a hit there resumes from a decode-written state.
        (3 * h.BLOCK, True),
        (h.PROMPT + h.BLOCK, True),
        (h.DECODE_HIT, True),
    ],
)
def test_a_decode_region_hit_ends_past_the_prompt(cached: int, reaches: bool) -> None:
    history = h.history([h.plan(0)], h.conversation(0, turn2_cached=cached))
    assert gates.reaches_decode_region(history, 0, Arm.TREATMENT) is reaches


def test_a_failed_turn2_is_not_a_decode_region_hit() -> None:
    failed = h.exchange(0, Arm.TREATMENT, Kind.TURN2, cached=h.DECODE_HIT, error="ReadTimeout: ")
    history = h.history([h.plan(0)], [failed])
    assert gates.decode_region_hits(history, Arm.TREATMENT) == []


def test_too_few_decode_region_hits_is_trigger_not_exercised() -> None:
    base = h.healthy()
    # 1 of 4 reaches the decode region; the default needs half.
    shrunk = [
        dataclasses.replace(e, cached_tokens=h.PROMPT_HIT)
        if e.kind == Kind.TURN2 and e.arm == Arm.TREATMENT and e.conversation > 0
        else e
        for e in base.exchanges
    ]
    history = dataclasses.replace(base, exchanges=tuple(shrunk))
    finding = assert_only_failure(history, "trigger", errors.TriggerNotExercised)
    assert (finding.figures["decode_region_hits"], finding.figures["needed"]) == (1, 2)
    relaxed = gates.trigger(history, Grading(min_trigger_fraction=0.25))
    assert relaxed.status is Status.PASS


def test_cached_tokens_absent_points_at_prompt_tokens_details() -> None:
    finding = assert_only_failure(h.healthy(turn2_cached=None), "trigger", errors.TriggerNotExercised)
    assert "reported no usage.prompt_tokens_details.cached_tokens" in finding.reason
    assert "--enable-prompt-tokens-details" in finding.hint


# --- drafter-live -------------------------------------------------------------------------------------------


def test_zero_drafts_is_spec_decode_not_engaged() -> None:
    history = h.healthy(DRAFTS=0, DRAFT_TOKENS=0, ACCEPTED=0, ACCEPTED_PER_POS=None)
    finding = assert_only_failure(history, "drafter-live", errors.SpecDecodeNotEngaged)
    assert "proposed 0 drafts" in finding.reason


def test_drafts_without_acceptance_is_spec_decode_not_engaged() -> None:
    finding = assert_only_failure(h.healthy(ACCEPTED=0), "drafter-live", errors.SpecDecodeNotEngaged)
    assert "0 tokens were accepted" in finding.reason


def test_no_spec_decode_metrics_is_spec_decode_not_engaged() -> None:
    history = h.healthy(DRAFTS=None, DRAFT_TOKENS=None, ACCEPTED=None, ACCEPTED_PER_POS=None)
    finding = assert_only_failure(history, "drafter-live", errors.SpecDecodeNotEngaged)
    assert "no speculative-decoding counters" in finding.reason
    assert "--speculative-config" in finding.hint


# --- counters -----------------------------------------------------------------------------------------------


def test_a_server_restart_mid_run_is_a_counter_reset() -> None:
    base = h.healthy()
    restarted = dict(h.LIVE)
    # The control restarted: its counters read lower after the run than before it.
    control = h.delta({metrics.CACHE_QUERIES: 9000}, {metrics.CACHE_QUERIES: 500})
    history = dataclasses.replace(base, deltas={Arm.TREATMENT: h.delta(restarted, restarted), Arm.CONTROL: control})
    found = by_check(history)
    assert found["counters"].error_class == "CounterReset"
    assert "control" in found["counters"].reason
    assert "went backwards (9000 -> 500)" in found["counters"].reason
    assert merge(found.values()).status is Status.UNKNOWN


def test_a_treatment_restart_is_never_read_as_a_live_cache() -> None:
    before = {**h.LIVE, metrics.CACHE_HITS: 5000}
    after = {**h.LIVE, metrics.CACHE_HITS: 100}
    history = dataclasses.replace(h.healthy(), deltas={Arm.TREATMENT: h.delta(before, after)})
    found = by_check(history)
    assert found["counters"].error_class == "CounterReset"
    assert found["cache-live"].status is not Status.PASS  # a negative delta is not a hit
    assert merge(found.values()).exit_code == 2


# --- endpoints ----------------------------------------------------------------------------------------------


def test_failed_exchanges_are_an_endpoint_error() -> None:
    base = h.healthy()
    failed = h.exchange(2, Arm.CONTROL, Kind.TURN2, error="EndpointError: HTTP 500: boom")
    exchanges = tuple(failed if e.case_id == failed.case_id else e for e in base.exchanges)
    finding = assert_only_failure(dataclasses.replace(base, exchanges=exchanges), "endpoints", errors.EndpointError)
    assert finding.status is Status.ERROR
    assert finding.figures["failed"] == {Arm.CONTROL: 1}
    assert "1 of 24 requests failed" in finding.reason
    assert "c002-control-turn2" in finding.reason
    assert "HTTP 500" in finding.reason


def test_a_failed_gate_outranks_a_corruption_finding() -> None:
    # The verdict rule: no grader counts on a run whose premises failed, so a FAIL is only ever corruption.
    gate_findings = gates.all_gates(h.healthy(CACHE_HITS=0), GRADING)
    fail = dataclasses.replace(Finding.from_error("logprob", errors.CorruptionDetected("differs")), stage="grader")
    verdict = merge([*gate_findings, fail])
    assert (verdict.status, verdict.error_class, verdict.exit_code) == (Status.UNKNOWN, "CacheNotLive", 2)


def _asking(exchange: Exchange, tokens: tuple[TokenLogprob, ...]) -> Exchange:
    return dataclasses.replace(exchange, request={"logprobs": True}, tokens=tokens, completion_tokens=len(tokens) or 3)


@pytest.mark.parametrize(
    ("tokens", "what"),
    [
        ((), "without logprobs"),
        (h.tokens(-0.1, math.nan), "NaN or infinite"),
        ((TokenLogprob("w", -0.1, (("w", -0.1), ("x", -math.inf))),), "NaN or infinite"),
    ],
)
def test_answers_without_finite_logprobs_are_an_endpoint_error(tokens: tuple[TokenLogprob, ...], what: str) -> None:
    base = h.healthy()
    exchanges = [_asking(e, tokens if i == 3 else h.tokens(-0.1)) for i, e in enumerate(base.exchanges)]
    finding = assert_only_failure(
        dataclasses.replace(base, exchanges=tuple(exchanges)), "logprobs", errors.EndpointError
    )
    assert what in finding.reason and base.exchanges[3].case_id in finding.reason
    assert "logprobs" in finding.hint
