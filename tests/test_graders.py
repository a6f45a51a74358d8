"""Graders on hand-built histories. Each compares the treatment's hit-vs-recomputation deviations with a yardstick
measured in the same run (the reference's, for exactness and logprob) or counts recall flips against two
baselines, and must have the power to fail before it may pass."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import pytest
from scipy import stats as sp

from blackbox import evidence, graders, stats
from blackbox.compare import deviation
from blackbox.config import Grading
from blackbox.gates import in_prefill_region
from blackbox.history import Arm, Exchange, History, Kind, TokenLogprob
from blackbox.metrics import MetricsDelta
from blackbox.verdict import Finding, Status, merge

import histories as h

GRADING = Grading()
LEVEL = GRADING.alpha / 3  # one grader alone: its alpha split over its three tests

Answer = float | Sequence[TokenLogprob]


# --- the deviation every grader reads (compare.deviation; race's own cases are in test_race) ------------------


def test_identical_answers_deviate_by_nothing_and_a_missing_tail_infinitely() -> None:
    seq = h.tokens(-0.1, -0.2, -0.3)
    assert deviation(seq, seq, 1.0) == 0.0
    assert deviation(seq[:2], seq, 1.0) == math.inf  # a different length is never a near-tie


def test_the_hard_margin_decides_whether_a_flip_is_confident() -> None:
    for margin, expected in ((0.0156, 0.0), (2.0, math.inf)):  # recomputation hesitated, or was 2 nats sure
        hit = h.tokens(-0.1, -0.2, -0.3, words=["a", "b", "c"], margin=margin)
        fresh = h.tokens(-0.1, -0.2, -0.3, words=["a", "b", "x"], margin=margin)
        assert deviation(hit, fresh, 1.0) == expected


def test_the_deviation_is_the_largest_shift_over_shared_top_tokens() -> None:
    hit = (TokenLogprob("a", -0.5, (("a", -0.5), ("b", -1.4), ("c", -3.0))), *h.tokens(-0.2, -0.4))
    fresh = (TokenLogprob("a", -0.6, (("a", -0.6), ("b", -1.0), ("d", -2.0))), *h.tokens(-0.25, -0.1))
    # b moved 0.4 at the first token (c and d are listed by one side only); the later 0.05 and 0.3 are smaller
    assert deviation(hit, fresh, 1.0) == pytest.approx(0.4)


def test_the_deviation_stops_at_the_first_differing_token() -> None:
    hit = h.tokens(-0.1, -0.2, -0.3, -0.4, words=["a", "b", "c", "d"])
    fresh = h.tokens(-0.1, -0.5, -9.0, -9.0, words=["a", "b", "x", "d"])
    # margin 2 < 3: a near-tie; b moved 0.3, and d's shift after the flip is not counted
    assert deviation(hit, fresh, 3.0) == pytest.approx(0.3)
    assert deviation(hit, fresh, 1.0) == math.inf


def test_a_first_token_flip_compares_that_position() -> None:
    hit = (TokenLogprob("a", -0.9, (("a", -0.9), ("b", -1.0))),)
    fresh = (TokenLogprob("b", -0.6, (("b", -0.6), ("a", -0.7))),)
    assert deviation(hit, fresh, 1.0) == pytest.approx(0.4)  # b: -1.0 vs -0.6; recomputation's margin 0.1


def test_without_top_lists_the_chosen_token_is_compared() -> None:
    assert deviation((TokenLogprob("a", -0.5),), (TokenLogprob("a", -0.2),), 1.0) == pytest.approx(0.3)


def test_answers_without_logprobs_are_not_samples() -> None:
    # Two empty lists compare equal vacuously: such a pair must not count as a bit-identical hit.
    history = probe_history([(), 0.0], [0.0, 0.0])
    found = graders.samples(history, Arm.TREATMENT, [(Kind.PROBE, Kind.PROBE_FRESH)], in_prefill_region, 1.0)
    assert [s.unit for s in found] == [1]


# --- exactness: prefill-region probes, treatment against reference -------------------------------------------

CLEAN = h.tokens(-0.1, -0.2, -0.3)


def probe_tokens(a: Answer) -> Sequence[TokenLogprob]:
    """CLEAN with its first logprob moved down by `a` nats, or `a` itself."""
    return h.tokens(-0.1 - a, -0.2, -0.3) if isinstance(a, float) else a


def probe_pair(index: int, arm: str, hit: Answer, *, cached: int | None = h.PROMPT_HIT) -> list[Exchange]:
    return [
        h.exchange(index, arm, Kind.PROBE, cached=cached, toks=probe_tokens(hit), text=h.ANSWER),
        h.exchange(index, arm, Kind.PROBE_FRESH, cached=0, toks=CLEAN),
    ]


def probe_history(
    treatment: Sequence[Answer],
    reference: Sequence[Answer] | None,
    *extra: Exchange,
    cached: int | None = h.PROMPT_HIT,
) -> History:
    """One conversation per entry: each arm's probe against CLEAN (its recomputation); 0.0 is bit-identical."""
    exchanges = [e for i, a in enumerate(treatment) for e in probe_pair(i, Arm.TREATMENT, a, cached=cached)]
    exchanges += [e for i, a in enumerate(reference or ()) for e in probe_pair(i, Arm.REFERENCE, a)]
    n = max(len(treatment), len(reference or ()))
    return h.history([h.plan(i) for i in range(n)], [*exchanges, *extra])


EXACT = [0.0] * 12  # a reference bit-identical to its recomputation
NOISE = [3e-4 * (1 + 0.1 * (i % 5)) for i in range(12)]  # a reference that is not (3e-4 .. 4.2e-4 nat)
BROKEN = [0.3 * (1 + 0.05 * (i % 5)) for i in range(12)]


def test_exactness_without_a_reference_is_no_evidence() -> None:
    # The old grader demanded bit-exactness of the treatment alone; a correct engine need not give it (a chunked
    # prefill, a GPU's reduction order), so now only the reference, measured in the same run, says what is normal.
    finding = graders.exactness(probe_history(BROKEN, None), GRADING)
    assert finding.error_class == "NoEvidence"
    assert "reference server" in finding.reason


def test_identical_probes_on_both_arms_pass_in_exact_mode() -> None:
    finding = graders.exactness(probe_history(EXACT, EXACT), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["counted"] == "differs"  # the reference is bit-exact: any difference counts
    assert (finding.figures["n_subject"], finding.figures["n_yardstick"]) == (12, 12)
    assert finding.figures["subject_identical"] == finding.figures["yardstick_identical"] == 12
    assert "any difference from recomputation in >= " in finding.reason
    assert "would have been detected with probability 0.95" in finding.reason


def test_treatment_differences_against_a_bit_exact_reference_are_counted_by_fisher() -> None:
    # 8 of 12 probes off by 1e-7 against 12 bit-identical: Fisher p = C(12,8)/C(24,8) < alpha/3.
    treatment = [1e-7] * 8 + [0.0] * 4
    finding = graders.exactness(probe_history(treatment, EXACT), GRADING)
    assert finding.status is Status.FAIL, finding.reason
    assert finding.error_class == "CorruptionDetected"
    assert (finding.figures["counted"], finding.figures["subject_count"], finding.figures["yardstick_count"]) == (
        "differs",
        8,
        0,
    )
    assert finding.figures["p_values"]["count"] == pytest.approx(math.comb(12, 8) / math.comb(24, 8))
    assert [m["unit"] for m in finding.figures["mismatches"]] == list(range(8))
    assert "8/12 differ from recomputation vs 0/12" in finding.reason
    assert "replay conversations" in finding.hint


def test_one_differing_probe_is_not_enough() -> None:
    # The old grader failed on one differing logprob. Now one of 12 against 0 of 12 is Fisher p = 1/2: a fault in
    # one hit in twelve is below what 12 conversations can see, and the PASS says how large a fraction they could.
    finding = graders.exactness(probe_history([1e-7] + [0.0] * 11, EXACT), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["p_values"]["count"] == pytest.approx(0.5)
    assert finding.figures["detectable_fraction"] > 1 / 12


@pytest.mark.parametrize("how", ["top-list", "length"])
def test_a_different_top_list_or_length_is_a_difference(how: str) -> None:
    hit = h.tokens(-0.1, -0.2, -0.3)
    reordered = (hit[0], TokenLogprob(hit[1].token, hit[1].logprob, (hit[1].top[0], ("other", -5.0))), hit[2])
    toks = reordered if how == "top-list" else hit[:2]
    finding = graders.exactness(probe_history([toks] * 8, EXACT[:8]), GRADING)
    assert finding.status is Status.FAIL, finding.reason
    assert finding.figures["p_values"]["count"] == pytest.approx(1 / math.comb(16, 8))
    if how == "top-list":  # no listed token moved (deviation 0): only the count of differences sees it
        assert finding.figures["p_values"]["deviations beyond the yardstick"] == 1.0


def test_a_treatment_within_the_references_noise_passes() -> None:
    # The reference is not bit-exact here, so neither need the treatment be: every treatment probe differs from
    # its recomputation, by no more than the reference's do.
    finding = graders.exactness(probe_history(NOISE[::-1], NOISE), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["counted"] == "hard"  # only confident flips are counted
    assert finding.figures["subject_identical"] == 0
    # the detectable size is beyond 1.25x the reference's largest (0.00042 nat)
    assert "a deviation beyond 0.000525 nat (1.25x their largest) in >= " in finding.reason
    # the same reference against a treatment far beyond it
    broken = graders.exactness(probe_history(BROKEN, NOISE), GRADING)
    assert broken.status is Status.FAIL, broken.reason
    assert broken.figures["p_values"]["deviations beyond the yardstick"] < LEVEL


def turn2_pairs(arm: str, answers: Sequence[Answer], *, first: int = 0, cached: int = h.PROMPT_HIT) -> list[Exchange]:
    """Turn-2 hits of `cached` tokens (by default stopped in the prompt region), each answer against CLEAN."""
    return [
        e
        for i, a in enumerate(answers)
        for e in h.resumed(first + i, arm, cached=cached, hit=probe_tokens(a), fresh=CLEAN)
    ]


def test_turn2_hits_in_the_prompt_region_are_graded_against_the_references_own() -> None:
    # A turn-2 hit that stopped inside the prompt (a decode checkpoint was missing) resumed from a prefill-written
    # state like the probe: exactness judges it, against the reference's turn-2 hits that stopped there too. A
    # decode-region turn-2 hit belongs to logprob, however far off.
    decode = turn2_pairs(Arm.TREATMENT, BROKEN, first=12, cached=h.DECODE_HIT)
    history = h.history([h.plan(i) for i in range(24)], probe_history(EXACT, EXACT, *decode).exchanges)
    finding = graders.exactness(history, GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert (finding.figures["n_subject"], finding.figures["not_graded"]) == (12, {})
    # Twelve far-off prompt-region turn-2 hits with no reference turn-2 hit there: not graded, and said so.
    history = h.history(history.plans, [*history.exchanges, *turn2_pairs(Arm.TREATMENT, BROKEN)])
    alone = graders.exactness(history, GRADING)
    assert alone.status is Status.PASS, alone.reason
    assert alone.figures["not_graded"] == {Kind.TURN2: 12}
    assert "not graded: 12 turn-2 hits of the treatment, which the reference has none of" in alone.reason
    # With the reference's own (exact) prompt-region turn-2 hits they are graded, and they fail.
    history = h.history(history.plans, [*history.exchanges, *turn2_pairs(Arm.REFERENCE, EXACT)])
    finding = graders.exactness(history, GRADING)
    assert finding.status is Status.FAIL, finding.reason
    assert finding.figures["n_subject"] == 12 and finding.figures["not_graded"] == {}
    assert set(finding.figures["strata"]) == {Kind.PROBE, Kind.TURN2}
    assert finding.figures["strata"][Kind.PROBE]["status"] == "PASS"
    assert finding.figures["alpha"] == pytest.approx(GRADING.alpha / 2)  # two strata share the grader's alpha
    assert "turn-2 hits deviate from recomputation more than the reference's do" in finding.reason
    # Two turn-2 hits against two cannot fail at any share: dropped and named, the probes judged at all of alpha.
    few = [*turn2_pairs(Arm.TREATMENT, BROKEN[:2]), *turn2_pairs(Arm.REFERENCE, EXACT[:2])]
    history = h.history(history.plans, [*probe_history(EXACT, EXACT).exchanges, *few])
    finding = graders.exactness(history, GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["alpha"] == GRADING.alpha
    assert finding.figures["too_few_to_fail"] == {Kind.TURN2: [2, 2]}
    assert "(not graded: 2 turn-2 hits against 2 could not reach significance)" in finding.reason


def test_prompt_region_turn2_hits_are_not_pooled_with_probes() -> None:
    # A correct engine: probes on both arms within the same noise; the treatment's turn-2 hits that stopped in the
    # prompt region (which the reference, with no missing decode checkpoints, does not have) resumed from a longer
    # prompt and deviate a little more. Pooled against the reference's probes, 16 of 48 beyond their largest read
    # CorruptionDetected; like with like, the probes pass and the turn-2 hits are not graded.
    noise = [3e-4 * (1 + 0.01 * i) for i in range(32)]
    longer = [2 * max(noise) * (1 + 0.01 * i) for i in range(16)]
    history = probe_history(noise[::-1], noise, *turn2_pairs(Arm.TREATMENT, longer))
    finding = graders.exactness(history, GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert (finding.figures["n_subject"], finding.figures["n_yardstick"]) == (32, 32)
    assert finding.figures["not_graded"] == {Kind.TURN2: 16}
    pooled = evidence.judge_samples(
        "exactness",
        graders.samples(history, Arm.TREATMENT, graders.EXACTNESS.pairs, in_prefill_region, 1.0, 4),
        graders.samples(history, Arm.REFERENCE, graders.EXACTNESS.pairs, in_prefill_region, 1.0, 4),
        alpha=GRADING.alpha,
        what="hits",
        against="the reference's",
        runs=32,
        hint="",
    )
    assert pooled.error_class == "CorruptionDetected"  # the old rule's reading of this correct engine


@pytest.mark.parametrize("cached", [None, 0, h.PROMPT + 1, h.DECODE_HIT])
def test_no_prefill_region_probe_is_no_evidence(cached: int | None) -> None:
    finding = graders.exactness(probe_history(BROKEN, EXACT, cached=cached), GRADING)
    assert finding.error_class == "NoEvidence"
    assert "no prefill-region hits to compare (treatment 0, reference 12)" in finding.reason


def test_a_probe_ending_at_the_prompts_end_is_prefill_region() -> None:
    finding = graders.exactness(probe_history(BROKEN, EXACT, cached=h.PROMPT), GRADING)
    assert finding.status is Status.FAIL, finding.reason


def test_a_failed_fresh_request_is_not_compared() -> None:
    history = probe_history(BROKEN, EXACT)
    failed = [
        h.exchange(e.conversation, e.arm, e.kind, error="HTTP 500")
        if (e.arm, e.kind) == (Arm.TREATMENT, Kind.PROBE_FRESH)
        else e
        for e in history.exchanges
    ]
    assert graders.exactness(h.history(history.plans, failed), GRADING).error_class == "NoEvidence"


def test_too_few_probes_is_insufficient_power() -> None:
    # 3 against 3: the smallest attainable p is 1/C(6,3) = 0.05 > alpha/3, so even 3 broken probes cannot FAIL.
    finding = graders.exactness(probe_history(BROKEN[:3], EXACT[:3]), GRADING)
    assert finding.status is Status.UNKNOWN
    assert finding.error_class == "InsufficientPower"
    need = finding.figures["conversations_needed"]
    assert isinstance(need, int) and need > 3
    assert f"run about {need} conversations" in finding.hint
    # and the run length it names can fail
    longer = graders.exactness(probe_history(BROKEN[:1] * need, EXACT[:1] * need), GRADING)
    assert longer.status is Status.FAIL, longer.reason


# --- recall -------------------------------------------------------------------------------------------------

WRONG = "zulu zulu zulu"
Row = tuple[bool, bool, bool]  # (cache hit recalled, treatment's own no-reuse answer recalled, control recalled)

HIT_LOST: Row = (False, True, True)  # a forward flip: both baselines recalled, the hit did not
HIT_FOUND: Row = (True, False, False)  # a reverse flip
ALL_RIGHT: Row = (True, True, True)
WEAKER: Row = (False, False, True)  # the treatment's model misses it with or without reuse


def recall_history(rows: Sequence[Row], *, cached: int = h.DECODE_HIT) -> History:
    exchanges = []
    for i, (hit_ok, fresh_ok, control_ok) in enumerate(rows):
        turn = h.resumed(i, Arm.TREATMENT, cached=cached, text=h.ANSWER if hit_ok else WRONG)
        turn[2] = dataclasses.replace(turn[2], text=h.ANSWER if fresh_ok else WRONG)  # the no-reuse answer
        exchanges += [*turn, h.exchange(i, Arm.CONTROL, Kind.TURN2, text=h.ANSWER if control_ok else WRONG)]
    return h.history([h.plan(i) for i in range(len(rows))], exchanges)


def test_a_control_that_cannot_recall_is_control_quality_failure() -> None:
    finding = graders.recall(recall_history([(False, False, False)] * 10 + [ALL_RIGHT] * 2), GRADING)
    assert finding.status is Status.UNKNOWN
    assert finding.error_class == "ControlQualityFailure"
    assert finding.figures["control_recall"] == pytest.approx(2 / 12)


def test_eight_forward_flips_and_no_reverse_is_corruption() -> None:
    finding = graders.recall(recall_history([HIT_LOST] * 8 + [ALL_RIGHT] * 4), GRADING)
    assert finding.status is Status.FAIL
    assert finding.error_class == "CorruptionDetected"
    assert finding.figures["forward_flips"] == list(range(8))
    assert finding.figures["reverse_flips"] == []
    assert finding.figures["p_value"] == pytest.approx(1 / 256)
    # 12 rows, critical count 7 (2^-7 < 0.01): the fraction caught at power 0.95 solves P(Bin(12, q) >= 7) = 0.95
    q = finding.figures["detectable_fraction"]
    assert sp.binom.sf(6, 12, q) == pytest.approx(0.95, abs=1e-6)
    assert "conversations [0, 1, 2, 3, 4, 5, 6, 7]" in finding.hint


def test_balanced_flips_pass_and_say_what_they_could_have_seen() -> None:
    finding = graders.recall(recall_history([HIT_LOST] * 3 + [HIT_FOUND] * 3 + [ALL_RIGHT] * 6), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["p_value"] == pytest.approx(42 / 64)
    assert finding.figures["baselines_right"] == 9
    assert finding.figures["treatment_recall"] == finding.figures["control_recall"] == pytest.approx(0.75)
    assert "would have been detected with probability 0.95" in finding.reason


def test_a_treatment_that_is_simply_weaker_is_not_corruption() -> None:
    # The treatment misses 8 needles with and without reuse; the control finds them. Against the control alone
    # (the old rule) that is 8 forward flips; against the treatment's own no-reuse answer it is none.
    finding = graders.recall(recall_history([WEAKER] * 8 + [ALL_RIGHT] * 8), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["forward_flips"] == []
    assert finding.figures["baselines_right"] == 8
    assert finding.figures["no_reuse_recall"] == finding.figures["treatment_recall"] == pytest.approx(0.5)
    assert finding.figures["control_recall"] == 1.0
    # the same misses on cache hits alone are corruption
    assert graders.recall(recall_history([HIT_LOST] * 8 + [ALL_RIGHT] * 8), GRADING).status is Status.FAIL


def test_too_few_rows_with_both_baselines_right_is_insufficient_power() -> None:
    # 6 rows whose baselines recalled: even 6 forward flips are p = 2^-6 > 0.01.
    finding = graders.recall(recall_history([HIT_LOST] * 6 + [WEAKER] * 6), GRADING)
    assert finding.status is Status.UNKNOWN
    assert finding.error_class == "InsufficientPower"
    assert finding.figures["baselines_right"] == 6


def test_recall_ignores_case_and_line_breaks() -> None:
    history = recall_history([ALL_RIGHT] * 3)
    shouted = [
        dataclasses.replace(e, text="Alpha\n  BRAVO two.") if e.kind in (Kind.TURN2, Kind.TURN2_FRESH) else e
        for e in history.exchanges
    ]
    finding = graders.recall(h.history(history.plans, shouted), GRADING)
    assert finding.figures["treatment_recall"] == 1.0
    assert finding.figures["no_reuse_recall"] == 1.0
    assert finding.figures["control_recall"] == 1.0


def test_recall_needs_decode_region_hits() -> None:
    # Forward flips on prompt-region hits do not exercise the trigger: no evidence, not FAIL.
    finding = graders.recall(recall_history([HIT_LOST] * 8, cached=h.PROMPT_HIT), GRADING)
    assert finding.error_class == "NoEvidence"
    # A hit one token past turn 1's prompt resumes from a decode-completed block: that is the decode region.
    assert graders.recall(recall_history([HIT_LOST] * 8, cached=h.PROMPT + 1), GRADING).status is Status.FAIL


def test_recall_needs_the_no_reuse_answer() -> None:
    history = recall_history([HIT_LOST] * 8)
    without = h.history(history.plans, [e for e in history.exchanges if e.kind != Kind.TURN2_FRESH])
    assert graders.recall(without, GRADING).error_class == "NoEvidence"


def test_without_a_control_recall_judges_against_the_no_reuse_answer_alone() -> None:
    # Single-endpoint mode (a staging smoke test): the treatment's fresh-salt answer is the only baseline.
    history = recall_history([HIT_LOST] * 8)
    alone = h.history(history.plans, [e for e in history.exchanges if e.arm != Arm.CONTROL])
    finding = graders.recall(alone, GRADING)
    assert finding.status is Status.FAIL and finding.figures["control_recall"] == 1.0


# --- logprob: decode-region turn-2 hits, treatment against reference ------------------------------------------


def logprob_history(
    treatment: Sequence[float],
    reference: Sequence[float] | None,
    *,
    hard_t: int = 0,
    hard_r: int = 0,
    margin_t: float = 3.0,
    cached: int = h.DECODE_HIT,
) -> History:
    """Per conversation, each arm's first-token logprob shift (hit vs no-reuse); the first `hard_*` conversations
    also part at position 2, where recomputation's margin is `margin_t` (treatment) or 3 nats (reference)."""
    n = max(len(treatment), len(reference or []))
    exchanges: list[Exchange] = []
    for arm, shifts, hard, margin in (
        (Arm.TREATMENT, treatment, hard_t, margin_t),
        (Arm.REFERENCE, reference or [], hard_r, 3.0),
    ):
        for i, shift in enumerate(shifts):
            fresh = h.tokens(-0.5, -0.2, -0.1, margin=margin)
            last = "x" if i < hard else "w2"
            hit = h.tokens(-0.5 - shift, -0.2, -0.1, words=["w0", "w1", last], margin=margin)
            exchanges += h.resumed(
                i, arm, cached=cached if arm == Arm.TREATMENT else h.DECODE_HIT, hit=hit, fresh=fresh
            )
    exchanges += [h.exchange(i, Arm.CONTROL, Kind.TURN2, text=h.ANSWER) for i in range(n)]
    return h.history([h.plan(i) for i in range(n)], exchanges)


def test_logprob_without_a_reference_is_no_evidence() -> None:
    finding = graders.logprob(logprob_history(BROKEN, None), GRADING)
    assert finding.error_class == "NoEvidence"
    assert "reference" in finding.reason


def test_large_deviations_against_a_quiet_reference_are_corruption() -> None:
    finding = graders.logprob(logprob_history(BROKEN, NOISE), GRADING)
    assert finding.status is Status.FAIL
    assert finding.error_class == "CorruptionDetected"
    assert finding.figures["alpha_per_test"] == pytest.approx(LEVEL)
    assert finding.figures["p_values"]["deviation shift"] < LEVEL
    assert finding.figures["p_values"]["deviations beyond the yardstick"] < LEVEL
    assert finding.figures["subject_deviation"]["median"] == pytest.approx(statistics.median(BROKEN))
    assert finding.figures["yardstick_deviation"]["median"] == pytest.approx(statistics.median(NOISE))
    assert (finding.figures["n_subject"], finding.figures["n_yardstick"]) == (12, 12)


def test_a_subset_of_conversations_far_beyond_the_reference_is_corruption() -> None:
    # A fault that fires in some conversations only: a third sits in the noise, the rest far above it.
    treatment = [*NOISE[:4], 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65]
    finding = graders.logprob(logprob_history(treatment, NOISE), GRADING)
    assert finding.status is Status.FAIL
    p = finding.figures["p_values"]["deviations beyond the yardstick"]
    # beyond the largest is the best threshold here; trying the 4 largest costs under a factor 2 in p
    single = math.comb(12, 8) / math.comb(24, 8)
    assert finding.figures["exceedance_rank"] == 1
    assert p == pytest.approx(stats.exceedance(treatment, NOISE, evidence.RANKS).p_value)
    assert single < p < 2 * single < LEVEL
    assert [m["unit"] for m in finding.figures["mismatches"]] == list(range(4, 12))


def _with_yardstick(n: int, treatment: Sequence[float], reference: Sequence[float]) -> History:
    """A logprob history whose reference also ran conversations n.. on its own (RunConfig.reference_ratio)."""
    full = logprob_history(treatment, reference)
    extra = [e for e in full.exchanges if e.conversation >= n and e.arm != Arm.REFERENCE]
    return dataclasses.replace(
        full,
        plans=full.plans[:n],
        yardstick=full.plans[n:],
        exchanges=tuple(e for e in full.exchanges if e not in extra),
    )


def test_a_larger_yardstick_catches_corruption_in_fewer_hits() -> None:
    # 6 of 32 hits far beyond the noise: below the exceedance test's critical count against 32 reference hits
    # (8 at alpha / 3), above it against 96 (5): C(32, 6) / C(32 + 96, 6) = 0.00017.
    noise = [0.01 + 0.001 * i for i in range(96)]
    treatment = [*(0.0105 + 0.0011 * i for i in range(26)), 5.0, 5.5, 6.0, 6.5, 7.0, 7.5]
    alone = graders.logprob(_with_yardstick(32, treatment, noise[:32]), GRADING)
    assert alone.status is Status.PASS, alone.reason
    assert alone.figures["n_yardstick"] == 32
    larger = graders.logprob(_with_yardstick(32, treatment, noise), GRADING)
    assert (larger.figures["n_subject"], larger.figures["n_yardstick"]) == (32, 96)
    assert larger.error_class == "CorruptionDetected", larger.reason
    p = larger.figures["p_values"]["deviations beyond the yardstick"]
    assert math.comb(32, 6) / math.comb(32 + 96, 6) < p < LEVEL
    assert alone.figures["detectable_fraction"] > larger.figures["detectable_fraction"]
    assert [m["unit"] for m in larger.figures["mismatches"]] == list(range(26, 32))


def test_yardstick_conversations_count_only_for_the_reference() -> None:
    history = _with_yardstick(4, [0.01] * 4, [0.02] * 8)
    assert [p.index for p in history.plans_of(Arm.TREATMENT)] == [0, 1, 2, 3]
    assert [p.index for p in history.plans_of(Arm.REFERENCE)] == list(range(8))
    assert history.plan(6) is not None
    assert len(graders.samples(history, Arm.REFERENCE, graders.LOGPROB.pairs, graders.LOGPROB.where, 1.0)) == 8


def test_a_treatment_a_little_noisier_than_its_reference_is_not_corruption() -> None:
    # A correct treatment that deviates a little more than its reference (states written during speculative
    # decoding, another reduction order): 8 of 12 hits 1.2x the reference's largest. Judged against the
    # reference's values themselves that is 8 beyond its largest, p = 0.0012 < 0.0033: it read FAIL. The
    # exceedance thresholds now sit at 1.25x, as the shift test's (p = 0.029).
    top = max(NOISE)
    treatment = [1.2 * top] * 8 + NOISE[:4]
    finding = graders.logprob(logprob_history(treatment, NOISE), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["exceedance_margin"] == 1.25
    assert stats.exceedance(treatment, NOISE, evidence.RANKS).p_value < LEVEL  # the old thresholds
    # a fault beyond the margin still fails: the same 8 hits at 1.3x
    corrupt = graders.logprob(logprob_history([1.3 * top] * 8 + NOISE[:4], NOISE), GRADING)
    assert corrupt.error_class == "CorruptionDetected", corrupt.reason
    assert "8 beyond 1.25x the largest of the reference's (0.000525 nat)" in corrupt.reason


def test_deviations_at_the_noise_floor_on_both_arms_pass_with_a_power_statement() -> None:
    finding = graders.logprob(logprob_history(NOISE, NOISE[::-1]), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert min(finding.figures["p_values"].values()) > 0.3
    q = finding.figures["detectable_fraction"]
    assert 0 < q < 1
    deep, q_deep = finding.figures["detectable_deviation_deep"], finding.figures["detectable_fraction_deep"]
    assert deep < finding.figures["detectable_deviation"] and q < q_deep < 1  # a smaller size, in more hits
    assert (
        f"in >= {q:.0%} of treatment decode-region hits, or beyond {deep:.3g} nat (1.25x their 4th largest) in >= "
        f"{q_deep:.0%}, would have been detected with probability 0.95"
    ) in finding.reason
    assert finding.figures["detection_power"] == 0.95
    # Twelve conversations promise far more than 20% of hits: the PASS names the run lengths for 20% and 10%.
    for20, for10 = finding.figures["conversations_for_20pct"], finding.figures["conversations_for_10pct"]
    assert len(NOISE) < for20 < for10
    assert f"; 20% would need about {for20}, 10% about {for10} conversations" in finding.reason
    # those lengths are for corruption beyond all of that longer run's reference; just beyond this one's largest
    # it is caught less often there (a larger reference reaches further), and the PASS says how often
    just = finding.figures["power_just_beyond_at_those"]
    assert just["20%"] == pytest.approx(stats.power_just_beyond(for20, for20, 12, LEVEL, 0.2, evidence.RANKS))
    assert just["10%"] < just["20%"] < 0.95
    assert f"(just beyond 0.000525 nat: probability >= {just['20%']:.2f}, {just['10%']:.2f})" in finding.reason


def test_a_pass_names_only_the_run_lengths_it_could_not_promise() -> None:
    """A run long enough for 20% of hits names only the length for 10%; one long enough for both, neither."""
    for conversations, asks in ((64, ["10%"]), (160, [])):
        stated = evidence._power(conversations, 2 * conversations, 0, LEVEL, (0.2, 0.18), "hits", conversations, "x")
        promised = stated[1]["detectable_fraction"]
        named = [f for f in ("20%", "10%") if f"{f} would need" in stated[0] or f"{f} about" in stated[0]]
        assert named == asks, stated[0]
        assert all(float(f[:-1]) / 100 < promised for f in named)


def _late_drift_history(position: int, deltas: dict[str, MetricsDelta] | None = None) -> History:
    """Twelve conversations whose treatment hits drift 2 nats from recomputation at answer `position` (and a
    confident flip right after), the reference's by noise only."""
    exchanges: list[Exchange] = []
    for i, noise in enumerate(NOISE):
        fresh = h.tokens(*[-0.5] * 8, margin=3.0)
        shifted = [-0.5 - noise] + [-0.5] * 7
        exchanges += h.resumed(i, Arm.REFERENCE, cached=h.DECODE_HIT, hit=h.tokens(*shifted, margin=3.0), fresh=fresh)
        drift = [-0.5 - noise] + [-0.5] * 7
        drift[position] -= 2.0
        words = [f"w{k}" for k in range(8)]
        words[min(position + 1, 7)] = "x"
        hit = h.tokens(*drift, words=words, margin=3.0)
        exchanges += h.resumed(i, Arm.TREATMENT, cached=h.DECODE_HIT, hit=hit, fresh=fresh)
    return h.history([h.plan(i) for i in range(len(NOISE))], exchanges, deltas)


def test_positions_past_compare_tokens_are_not_compared() -> None:
    # A GPU treatment's late answer positions drift under speculative decoding (draft splits differ between a hit
    # and its twin); only the first token and the first verification step are evidence about the restored state.
    two_tokens = {Arm.TREATMENT: h.live_delta()}  # 600 drafted tokens in 300 drafts: 2 speculative tokens
    late = graders.logprob(_late_drift_history(4, two_tokens), GRADING)
    assert late.status is Status.PASS, late.reason
    assert late.figures["compared_positions"] == 4
    assert late.figures["subject_deviation"]["max_finite"] == pytest.approx(max(NOISE))
    whole = dataclasses.replace(GRADING, compare_tokens=8)
    assert graders.logprob(_late_drift_history(4, two_tokens), whole).error_class == "CorruptionDetected"
    assert graders.logprob(_late_drift_history(3, two_tokens), GRADING).error_class == "CorruptionDetected"
    # With 1 speculative token the first verification step ends at position 3: position 4 (index 3) is later.
    one_token = {Arm.TREATMENT: h.live_delta(DRAFT_TOKENS=300)}
    assert graders.logprob(_late_drift_history(3, one_token), GRADING).status is Status.PASS
    assert graders.logprob(_late_drift_history(2, one_token), GRADING).error_class == "CorruptionDetected"


@pytest.mark.parametrize(
    ("deltas", "asked", "positions"),
    [
        ({Arm.TREATMENT: h.live_delta()}, None, 4),
        ({Arm.TREATMENT: h.live_delta(DRAFT_TOKENS=300)}, None, 3),
        ({Arm.TREATMENT: h.live_delta(DRAFT_TOKENS=900)}, None, 5),
        ({Arm.TREATMENT: h.live_delta(DRAFTS=None, DRAFT_TOKENS=None)}, None, 4),  # /metrics does not say
        ({}, None, 4),
        ({Arm.TREATMENT: h.live_delta(DRAFT_TOKENS=300)}, 6, 6),  # --compare-tokens wins
    ],
)
def test_compared_positions_are_the_first_token_and_one_verification_step(
    deltas: dict[str, MetricsDelta], asked: int | None, positions: int
) -> None:
    history = h.history([h.plan(0)], [], deltas)
    assert graders.compared_positions(history, Grading(compare_tokens=asked)) == positions


def test_a_small_systematic_shift_is_not_corruption_a_large_one_is() -> None:
    # As measured on the H200: the reference's hits bit-identical to recomputation in 13 of 32, the treatment's in
    # 1, all others one bf16 step (0.0625 nat) away. A correct engine's systematic difference, not corruption.
    reference = [0.0] * 13 + [0.0625] * 19
    treatment = [0.0] + [0.0625] * 31
    assert sp.mannwhitneyu(treatment, reference, alternative="greater").pvalue < LEVEL  # an unmargined shift test
    finding = graders.logprob(logprob_history(treatment, reference), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["shift_margin"] == 1.25
    # Every hit one step beyond the reference's largest: the shift test catches it (so does exceedance).
    large = graders.logprob(logprob_history([0.125] * 32, reference), GRADING)
    assert large.error_class == "CorruptionDetected"
    assert large.figures["p_values"]["deviation shift"] < LEVEL


def test_confident_token_flips_are_corruption() -> None:
    # Logprobs as noisy as the reference's up to position 2, where 10 treatment hits flip a token recomputation
    # was 3 nats sure of: infinite deviations, beyond every reference value, and counted by Fisher.
    finding = graders.logprob(logprob_history(NOISE, NOISE, hard_t=10), GRADING)
    assert finding.status is Status.FAIL
    assert finding.figures["counted"] == "hard"
    assert (finding.figures["subject_count"], finding.figures["yardstick_count"]) == (10, 0)
    assert finding.figures["subject_deviation"]["hard"] == 10
    assert finding.figures["p_values"]["count"] == pytest.approx(66 / 1961256)  # C(12,10) / C(24,10)
    assert "10/12 flip a confident token vs 0/12" in finding.reason


def test_near_tie_flips_are_not_confident() -> None:
    # The same flips where recomputation hesitated (margin 0.0156 < hard_margin 1): noise, against a noisy reference.
    finding = graders.logprob(logprob_history(NOISE, NOISE, hard_t=10, margin_t=0.0156), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["subject_count"] == 0
    assert finding.figures["subject_deviation"]["hard"] == 0
    # Against a reference that is bit-exact, though, any difference counts, near-tie flips included.
    exact = graders.logprob(logprob_history([0.0] * 12, [0.0] * 12, hard_t=10, margin_t=0.0156), GRADING)
    assert exact.status is Status.FAIL, exact.reason
    assert (exact.figures["counted"], exact.figures["subject_count"]) == ("differs", 10)


def test_too_few_qualifying_conversations_is_insufficient_power() -> None:
    # 2 treatment hits against 12: the smallest attainable p, 1/C(14,2) = 1/91, is above alpha/3.
    finding = graders.logprob(logprob_history(BROKEN[:2], NOISE), GRADING)
    assert finding.status is Status.UNKNOWN
    assert finding.error_class == "InsufficientPower"
    assert (finding.figures["n_subject"], finding.figures["n_yardstick"]) == (2, 12)
    need = finding.figures["conversations_needed"]
    assert isinstance(need, int) and need > 12
    assert f"run about {need} conversations" in finding.hint


def test_only_decode_region_hits_qualify_for_logprob() -> None:
    finding = graders.logprob(logprob_history(BROKEN, NOISE, cached=h.PROMPT), GRADING)
    assert finding.error_class == "NoEvidence"
    assert "no decode-region hits to compare (treatment 0, reference 12)" in finding.reason
    # one token past turn 1's prompt is the decode region
    assert graders.logprob(logprob_history(BROKEN, NOISE, cached=h.PROMPT + 1), GRADING).status is Status.FAIL


# --- grade() ------------------------------------------------------------------------------------------------


def exactness_only(n: int = 8) -> History:
    """Clean prefill-region probes on treatment and reference; turn-2 hits only in the prompt region and no
    control answers, so recall and logprob have nothing."""
    history = probe_history([0.0] * n, [0.0] * n)
    turn2 = [e for i in range(n) for e in h.resumed(i, Arm.TREATMENT, cached=h.PROMPT_HIT, hit=CLEAN)]
    return h.history(history.plans, [*history.exchanges, *turn2])


def graded(n: int = 10, *, control: bool = False) -> History:
    """Clean probes and clean decode-region turn-2 hits on treatment and reference; with `control`, control
    answers and a model that recalls, else one that cannot (so recall is not usable)."""
    history = probe_history([0.0] * n, [0.0] * n)
    text = h.ANSWER if control else "a story"
    turn2 = [
        e for i in range(n) for arm in (Arm.TREATMENT, Arm.REFERENCE) for e in h.resumed(i, arm, hit=CLEAN, text=text)
    ]
    controls = [h.exchange(i, Arm.CONTROL, Kind.TURN2, text=h.ANSWER) for i in range(n)] if control else []
    return h.history(history.plans, [*history.exchanges, *turn2, *controls])


def by_check(found: Sequence[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in found}


def test_auto_mode_leaves_out_graders_without_evidence_and_says_why() -> None:
    grades = graders.grade(exactness_only(), GRADING)
    assert grades.used == ("exactness",)
    assert [f.check for f in grades.findings] == ["exactness"]
    assert grades.findings[0].status is Status.PASS
    why = dict(grades.not_used)
    assert set(why) == {"recall", "logprob"}
    assert "decode-region hit" in why["recall"]
    assert "no decode-region hits" in why["logprob"]
    # Exactness judges prefill-region hits, not the decode-written blocks the trigger proved, so its PASS alone
    # no longer makes the run PASS (it did under the old rule).
    verdict = merge(grades.findings)
    assert (verdict.status, verdict.error_class) == (Status.UNKNOWN, "NoEvidence")


@pytest.mark.parametrize(("control", "used"), [(False, 2), (True, 3)], ids=["two-graders", "three-graders"])
def test_one_alpha_is_split_over_the_graders_used(control: bool, used: int) -> None:
    grades = graders.grade(graded(control=control), GRADING)
    assert len(grades.used) == used
    assert grades.alpha_per_grader == pytest.approx(GRADING.alpha / used)
    found = by_check(grades.findings)
    for name in ("exactness", "logprob"):
        assert found[name].status is Status.PASS, found[name].reason
        assert found[name].figures["alpha"] == pytest.approx(GRADING.alpha / used)
        assert found[name].figures["alpha_per_test"] == pytest.approx(GRADING.alpha / used / 3)
    assert [f.stage for f in grades.findings] == ["grader"] * used
    assert (found["exactness"].covers_trigger, found["logprob"].covers_trigger) == (False, True)
    # logprob judged the decode-written blocks with power: the run passes, stating what it could have seen
    verdict = merge(grades.findings)
    assert verdict.status is Status.PASS, verdict.reason
    assert "logprob: " in verdict.reason and "would have been detected with probability 0.95" in verdict.reason


def test_a_grader_named_explicitly_stays_unknown_without_evidence() -> None:
    grades = graders.grade(exactness_only(), Grading(graders=("exactness", "logprob")))
    assert grades.used == ("exactness",)  # used: had evidence and power; logprob is kept, not used
    assert grades.not_used == ()
    assert [f.status for f in grades.findings] == [Status.PASS, Status.UNKNOWN]
    verdict = merge(grades.findings)
    assert (verdict.status, verdict.exit_code) == (Status.UNKNOWN, 2)


def test_a_grader_named_explicitly_without_power_stays_unknown() -> None:
    history = recall_history([HIT_LOST] * 6 + [WEAKER] * 6)
    assert graders.grade(history, GRADING).used == ()  # auto mode: left out
    grades = graders.grade(history, Grading(graders=("recall",)))
    [finding] = grades.findings
    assert finding.error_class == "InsufficientPower"
    assert merge(grades.findings).exit_code == 2


@pytest.mark.parametrize("named", [(), ("exactness", "recall")])
def test_a_crashing_grader_is_unknown_never_pass(monkeypatch: pytest.MonkeyPatch, named: tuple[str, ...]) -> None:
    def crash(history: History, grading: Grading, alpha: float) -> Finding:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(graders.GRADER_FUNCTIONS, "recall", crash)
    grades = graders.grade(graded(control=True), Grading(graders=named))
    crashed = by_check(grades.findings)["recall"]
    assert crashed.status is Status.UNKNOWN
    assert "grader crashed: ZeroDivisionError" in crashed.reason
    # The other graders passed; the crash must still keep the run from PASS, in auto mode too.
    assert merge(grades.findings).status is Status.UNKNOWN


def test_a_run_where_every_grader_lacks_evidence_is_no_evidence() -> None:
    history = h.history([h.plan(0)], h.resumed(0, Arm.TREATMENT, cached=0))
    grades = graders.grade(history, GRADING)
    assert grades.used == ()
    assert grades.findings == ()  # nothing to merge; the reasons go to `not_used`
    assert {g for g, _ in grades.not_used} == {"exactness", "recall", "logprob"}
    verdict = merge(grades.findings)
    assert (verdict.status, verdict.error_class, verdict.exit_code) == (Status.UNKNOWN, "NoEvidence", 2)
    assert "no grader ran" in verdict.reason


def test_a_failing_grader_is_kept_in_auto_mode_at_its_full_share() -> None:
    history = recall_history([HIT_LOST] * 8 + [ALL_RIGHT] * 4)
    grades = graders.grade(history, GRADING)
    assert grades.used == ("recall",)
    assert grades.alpha_per_grader == GRADING.alpha  # exactness and logprob had no evidence: recall gets it all
    assert merge(grades.findings).status is Status.FAIL
    # p = 1/256 fails at 0.01 but not at the first pass's 0.01/3: the second pass is what caught it
    assert graders.recall(history, GRADING, GRADING.alpha / 3).status is Status.PASS


# --- what a finding lists and claims ------------------------------------------------------------------------


def test_every_counted_sample_is_listed_for_replay_even_at_zero_deviation() -> None:
    # Probes that differ only in their top list deviate by 0 (no shared token moved) yet count against an exact
    # reference: the FAIL must list them, or its hint points at nothing.
    toplist = (TokenLogprob("w0", -0.1, (("w0", -0.1), ("zz", -2.1))), *CLEAN[1:])
    finding = graders.exactness(probe_history([toplist] * 8, EXACT), GRADING)
    assert finding.status is Status.FAIL
    assert len(finding.figures["mismatches"]) == 8
    assert {m["deviation"] for m in finding.figures["mismatches"]} == {0.0}


def test_a_yardstick_holding_a_confident_flip_states_power_by_the_count_test() -> None:
    # Nothing lies beyond an infinite deviation, so the exceedance test can see nothing; the statement must come
    # from the count (Fisher) test instead of claiming a fraction beyond "a confident token flip".
    finding = graders.logprob(logprob_history([0.001] * 12, [0.001] * 12, hard_r=1), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert finding.figures["detectable_deviation"] == math.inf
    assert "confident token flips in >=" in finding.reason
    assert "beyond a confident token flip" not in finding.reason
    q = finding.figures["detectable_fraction"]
    assert q is not None and 0 < q < 1


def test_a_yardstick_whose_top_is_all_confident_flips_cannot_pass() -> None:
    # Nine of 32 hits 0.9 nat off, against a reference whose largest four are confident token flips: every
    # exceedance threshold is infinite, so nothing short of a flip could have been seen. The sizes allow a FAIL
    # (9 beyond a finite top is one); the realised values do not, so this is no PASS (it was, with exit 0).
    noise = [0.01 + 0.001 * i for i in range(32)]
    treatment = [*noise[:23], *[0.9] * 9]
    assert graders.logprob(logprob_history(treatment, noise), GRADING).error_class == "CorruptionDetected"
    blind = graders.logprob(logprob_history(treatment, noise, hard_r=4), GRADING)
    assert (blind.status, blind.error_class) == (Status.UNKNOWN, "InsufficientPower"), blind.reason
    assert "their 4 largest deviations are confident token flips" in blind.reason
    assert "--hard-margin" in blind.hint
    named = graders.grade(logprob_history(treatment, noise, hard_r=4), Grading(graders=("logprob",)))
    assert merge(named.findings).exit_code == 2
    # Three flips leave the 4th largest finite: a threshold the treatment could pass, so a PASS may stand.
    assert graders.logprob(logprob_history(treatment, noise, hard_r=3), GRADING).status is Status.PASS


def test_a_grader_without_evidence_takes_no_share_of_alpha() -> None:
    # Eight recalled rows reach p = 1/256 < 0.01 but not < 0.01/3: exactness and logprob have no reference here,
    # so recall must be run at the whole alpha, not at a third of it.
    grades = graders.grade(recall_history([HIT_LOST] * 8), GRADING)
    assert grades.used == ("recall",) and grades.alpha_per_grader == GRADING.alpha
    assert grades.findings[0].status is Status.FAIL
