"""Graders on hand-built histories: exact where the engine promises it, statistical where it does not."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import pytest

from blackbox import graders
from blackbox.config import Grading
from blackbox.history import Arm, Exchange, History, Kind, TokenLogprob
from blackbox.verdict import Status, merge

import histories as h

GRADING = Grading()


# --- divergence() and deviations() --------------------------------------------------------------------------


def deviations(hit: Sequence[TokenLogprob], fresh: Sequence[TokenLogprob]) -> tuple[float, float]:
    result = graders.deviations(hit, fresh)
    assert result is not None
    return result


def test_divergence_of_identical_sequences_is_none() -> None:
    seq = h.tokens(-0.1, -0.2, -0.3)
    assert graders.divergence(seq, seq) == graders.Divergence(-1, None)
    assert graders.divergence((), seq).position == -1


def test_divergence_reports_the_first_differing_token_and_the_fresh_margin() -> None:
    hit = h.tokens(-0.1, -0.2, -0.3, words=["a", "b", "c"])
    fresh = h.tokens(-0.1, -0.2, -0.3, words=["a", "b", "x"], margin=0.0156)
    d = graders.divergence(hit, fresh)
    assert d.position == 2
    assert d.margin == pytest.approx(0.0156)


def test_deviations_first_token_is_the_largest_shift_over_shared_top_tokens() -> None:
    hit = (TokenLogprob("a", -0.5, (("a", -0.5), ("b", -1.4), ("c", -3.0))), *h.tokens(-0.2, -0.4))
    fresh = (TokenLogprob("a", -0.6, (("a", -0.6), ("b", -1.0), ("d", -2.0))), *h.tokens(-0.25, -0.1))
    first, prefix = deviations(hit, fresh)
    assert first == pytest.approx(0.4)  # b moved 0.4; c and d are not listed by both
    assert prefix == pytest.approx(0.4)  # the first token's 0.4 beats the chosen tokens' 0.1, 0.05, 0.3


def test_deviations_prefix_stops_at_the_first_divergence() -> None:
    hit = h.tokens(-0.1, -0.2, -0.3, -0.4, words=["a", "b", "c", "d"])
    fresh = h.tokens(-0.1, -0.5, -9.0, -9.0, words=["a", "b", "x", "d"])
    first, prefix = deviations(hit, fresh)
    assert first == pytest.approx(0.0)
    assert prefix == pytest.approx(0.3)  # b moved 0.3; c differs, so d's shift is not counted


def test_deviations_when_the_first_token_differs() -> None:
    hit = (TokenLogprob("a", -0.9, (("a", -0.9), ("b", -1.0))),)
    fresh = (TokenLogprob("b", -0.6, (("b", -0.6), ("a", -0.7))),)
    first, prefix = deviations(hit, fresh)
    assert first == pytest.approx(0.4)  # b: -1.0 vs -0.6
    assert prefix == pytest.approx(0.4)  # nothing before the divergence: the first token's deviation


def test_deviations_without_top_lists_fall_back_to_the_chosen_token() -> None:
    first, prefix = deviations((TokenLogprob("a", -0.5),), (TokenLogprob("a", -0.2),))
    assert (first, prefix) == pytest.approx((0.3, 0.3))


def test_deviations_of_an_empty_answer_is_none() -> None:
    assert graders.deviations((), h.tokens(-0.1)) is None
    assert graders.deviations(h.tokens(-0.1), ()) is None


# --- exactness ----------------------------------------------------------------------------------------------


def exact_history(*exchanges: Exchange, n: int = 3) -> History:
    base = [e for i in range(n) for e in h.probe(i)]
    return h.history([h.plan(i) for i in range(n)], [*base, *exchanges])


def test_identical_prompt_region_pairs_pass() -> None:
    finding = graders.exactness(exact_history(), GRADING)
    assert finding.status is Status.PASS
    assert finding.figures == {"checked": 3, "mismatches": []}


def test_one_logprob_differing_in_the_prompt_region_is_corruption() -> None:
    hit = h.tokens(-0.1, -0.2, -0.3)
    fresh = h.tokens(-0.1, -0.2000001, -0.3)
    history = h.history([h.plan(i) for i in range(3)], [*h.probe(0), *h.probe(1, hit=hit, fresh=fresh), *h.probe(2)])
    finding = graders.exactness(history, GRADING)
    assert finding.status is Status.FAIL
    assert finding.error_class == "CorruptionDetected"
    assert "1 of 3" in finding.reason and "conversations [1]" in finding.reason
    [mismatch] = finding.figures["mismatches"]
    assert (mismatch["conversation"], mismatch["kind"], mismatch["position"]) == (1, Kind.PROBE, 1)
    assert mismatch["cached_tokens"] == h.PROMPT_HIT


def test_a_different_top_list_or_length_is_corruption() -> None:
    hit = h.tokens(-0.1, -0.2)
    reordered = (hit[0], TokenLogprob(hit[1].token, hit[1].logprob, (hit[1].top[0], ("other", -5.0))))
    for fresh in (reordered, hit[:1]):
        history = h.history([h.plan(0)], h.probe(0, hit=hit, fresh=fresh))
        assert graders.exactness(history, GRADING).status is Status.FAIL


def test_a_turn2_hit_ending_in_the_prompt_region_is_checked() -> None:
    turn2 = h.resumed(3, Arm.TREATMENT, cached=h.PROMPT_HIT, hit=h.tokens(-0.1, -0.2), fresh=h.tokens(-0.1, -0.7))
    history = exact_history(*turn2, n=4)
    finding = graders.exactness(history, GRADING)
    assert finding.status is Status.FAIL
    assert finding.figures["mismatches"][0]["kind"] == Kind.TURN2


def test_hits_beyond_the_prompt_region_are_ignored() -> None:
    # Decode-region hits legitimately differ from recomputation; exactness must not judge them.
    turn2 = h.resumed(0, Arm.TREATMENT, cached=h.DECODE_HIT, hit=h.tokens(-0.1, -0.2), fresh=h.tokens(-0.9, -0.7))
    finding = graders.exactness(exact_history(*turn2), GRADING)
    assert finding.status is Status.PASS
    assert finding.figures["checked"] == 3


@pytest.mark.parametrize("cached", [None, 0, h.PROMPT + 1, h.DECODE_HIT])
def test_no_eligible_hit_is_no_evidence(cached: int | None) -> None:
    history = h.history([h.plan(0)], h.probe(0, cached=cached, fresh=h.tokens(-5.0)))
    finding = graders.exactness(history, GRADING)
    assert finding.status is Status.UNKNOWN
    assert finding.error_class == "NoEvidence"


def test_a_failed_fresh_request_is_not_compared() -> None:
    hit, _ = h.probe(0)
    failed = h.exchange(0, Arm.TREATMENT, Kind.PROBE_FRESH, error="HTTP 500")
    assert graders.exactness(h.history([h.plan(0)], [hit, failed]), GRADING).error_class == "NoEvidence"


# --- recall -------------------------------------------------------------------------------------------------

WRONG = "zulu zulu zulu"


def recall_history(rows: list[tuple[bool, bool]], *, cached: int = h.DECODE_HIT) -> History:
    """One conversation per (treatment recalled, control recalled)."""
    exchanges = []
    for i, (t_ok, c_ok) in enumerate(rows):
        exchanges += h.resumed(i, Arm.TREATMENT, cached=cached, text=h.ANSWER if t_ok else WRONG)
        exchanges.append(h.exchange(i, Arm.CONTROL, Kind.TURN2, text=h.ANSWER if c_ok else WRONG))
    return h.history([h.plan(i) for i in range(len(rows))], exchanges)


def test_a_control_that_cannot_recall_is_control_quality_failure() -> None:
    finding = graders.recall(recall_history([(False, False)] * 10 + [(True, True)] * 2), GRADING)
    assert finding.status is Status.UNKNOWN
    assert finding.error_class == "ControlQualityFailure"
    assert finding.figures["control_recall"] == pytest.approx(2 / 12)


def test_eight_forward_flips_and_no_reverse_is_corruption() -> None:
    rows = [(False, True)] * 8 + [(True, True)] * 4
    finding = graders.recall(recall_history(rows), GRADING)
    assert finding.status is Status.FAIL
    assert finding.error_class == "CorruptionDetected"
    assert finding.figures["forward_flips"] == list(range(8))
    assert finding.figures["reverse_flips"] == []
    assert finding.figures["p_value"] == pytest.approx(1 / 256)
    assert finding.figures["min_detectable_drop"] == pytest.approx(7 / 12)
    assert "conversations [0, 1, 2, 3, 4, 5, 6, 7]" in finding.hint


def test_balanced_flips_pass() -> None:
    rows = [(False, True)] * 3 + [(True, False)] * 3 + [(True, True)] * 6
    finding = graders.recall(recall_history(rows), GRADING)
    assert finding.status is Status.PASS
    assert finding.figures["p_value"] == pytest.approx(42 / 64)
    assert finding.figures["min_detectable_drop"] == pytest.approx(7 / 12)
    assert finding.figures["treatment_recall"] == finding.figures["control_recall"] == pytest.approx(0.75)


def test_recall_ignores_case_and_line_breaks() -> None:
    history = recall_history([(True, True)] * 3)
    shouted = [
        dataclasses.replace(e, text="Alpha\n  BRAVO two.") if e.kind == Kind.TURN2 else e for e in history.exchanges
    ]
    history = h.history(history.plans, shouted)
    finding = graders.recall(history, GRADING)
    assert finding.figures["treatment_recall"] == 1.0
    assert finding.figures["control_recall"] == 1.0


def test_recall_needs_decode_region_hits() -> None:
    # Forward flips on prompt-region hits do not exercise the trigger: no evidence, not FAIL.
    finding = graders.recall(recall_history([(False, True)] * 8, cached=h.PROMPT_HIT), GRADING)
    assert finding.error_class == "NoEvidence"


def test_recall_needs_a_control_answer() -> None:
    history = recall_history([(True, True)] * 4)
    without_control = h.history(history.plans, [e for e in history.exchanges if e.arm != Arm.CONTROL])
    assert graders.recall(without_control, GRADING).error_class == "NoEvidence"


# --- logprob ------------------------------------------------------------------------------------------------


def logprob_history(
    treatment: list[float], reference: list[float] | None, *, hard_t: int = 0, hard_r: int = 0
) -> History:
    """Per conversation, the first-token logprob shift (hit vs no-reuse) on each arm; `hard_*` conversations
    diverge at position 2 where the no-reuse arm's margin was 3 nats."""
    n = max(len(treatment), len(reference or []))
    exchanges: list[Exchange] = []
    for arm, shifts, hard in ((Arm.TREATMENT, treatment, hard_t), (Arm.REFERENCE, reference, hard_r)):
        for i, shift in enumerate(shifts or []):
            fresh = h.tokens(-0.5, -0.2, -0.1, margin=3.0)
            last = "x" if i < hard else "w2"
            hit = h.tokens(-0.5 - shift, -0.2, -0.1, words=["w0", "w1", last], margin=3.0)
            exchanges += h.resumed(i, arm, hit=hit, fresh=fresh)
        exchanges += [h.exchange(i, Arm.CONTROL, Kind.TURN2, text=h.ANSWER) for i in range(len(shifts or []))]
    return h.history([h.plan(i) for i in range(n)], exchanges)


NOISE = [3e-4 * (1 + 0.1 * (i % 5)) for i in range(12)]
BROKEN = [0.3 * (1 + 0.05 * (i % 5)) for i in range(12)]


def test_logprob_without_a_reference_is_no_evidence() -> None:
    finding = graders.logprob(logprob_history(BROKEN, None), GRADING)
    assert finding.error_class == "NoEvidence"
    assert "reference" in finding.reason


def test_large_first_token_deviations_against_a_quiet_reference_are_corruption() -> None:
    finding = graders.logprob(logprob_history(BROKEN, NOISE), GRADING)
    assert finding.status is Status.FAIL
    assert finding.error_class == "CorruptionDetected"
    assert finding.figures["p_values"]["deviation shift"] < GRADING.alpha / 3
    assert finding.figures["p_values"]["deviations beyond the reference"] < GRADING.alpha / 3
    assert finding.figures["treatment_first_token"]["median"] == pytest.approx(statistics.median(BROKEN))
    assert finding.figures["reference_first_token"]["median"] == pytest.approx(statistics.median(NOISE))
    assert (finding.figures["n_treatment"], finding.figures["n_reference"]) == (12, 12)


def test_a_subset_of_conversations_far_beyond_the_reference_is_corruption() -> None:
    # A fault that fires in some conversations only: a third sits in the noise, the rest far above it.
    treatment = [*NOISE[:4], 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65]
    finding = graders.logprob(logprob_history(treatment, NOISE), GRADING)
    assert finding.status is Status.FAIL
    p = finding.figures["p_values"]["deviations beyond the reference"]
    assert p == pytest.approx(math.comb(12, 8) / math.comb(24, 8))


def test_deviations_at_the_noise_floor_on_both_arms_pass() -> None:
    finding = graders.logprob(logprob_history(NOISE, NOISE[::-1]), GRADING)
    assert finding.status is Status.PASS
    assert min(finding.figures["p_values"].values()) > 0.3


def test_hard_divergences_alone_are_corruption() -> None:
    # Logprobs equal up to the divergence, so only the count of confident divergences can tell the arms apart.
    finding = graders.logprob(logprob_history([0.0] * 12, [0.0] * 12, hard_t=10), GRADING)
    assert finding.status is Status.FAIL
    assert finding.figures["treatment_hard_divergences"] == 10
    assert finding.figures["reference_hard_divergences"] == 0
    p_values = finding.figures["p_values"]
    assert p_values["deviations beyond the reference"] == 1.0
    assert p_values["hard divergences"] == pytest.approx(66 / 1961256)  # C(12,10) / C(24,10)


def test_near_tie_divergences_are_not_hard() -> None:
    history = logprob_history([0.0] * 12, [0.0] * 12, hard_t=10)
    near_ties = [
        dataclasses.replace(e, tokens=h.tokens(-0.5, -0.2, -0.1, margin=0.0156)) if e.kind == Kind.TURN2_FRESH else e
        for e in history.exchanges
    ]
    finding = graders.logprob(h.history(history.plans, near_ties), GRADING)
    assert finding.status is Status.PASS
    assert finding.figures["treatment_hard_divergences"] == 0


def test_too_few_qualifying_conversations_is_no_evidence() -> None:
    finding = graders.logprob(logprob_history(BROKEN[:2], NOISE), GRADING)
    assert finding.error_class == "NoEvidence"
    assert "treatment 2, reference 12" in finding.reason


def test_only_decode_region_hits_qualify_for_logprob() -> None:
    history = logprob_history(BROKEN, NOISE)
    demoted = [
        dataclasses.replace(e, cached_tokens=h.PROMPT_HIT) if e.arm == Arm.TREATMENT and e.kind == Kind.TURN2 else e
        for e in history.exchanges
    ]
    finding = graders.logprob(h.history(history.plans, demoted), GRADING)
    assert finding.error_class == "NoEvidence"


# --- grade() ------------------------------------------------------------------------------------------------


def exactness_only() -> History:
    """Clean prefill-region probes; no decode-region hit and no reference, so recall and logprob have nothing."""
    return exact_history(*[e for i in range(3) for e in h.resumed(i, Arm.TREATMENT, cached=h.PROMPT_HIT)])


def test_auto_mode_leaves_out_graders_without_evidence_and_says_why() -> None:
    grades = graders.grade(exactness_only(), GRADING)
    assert grades.used == ("exactness",)
    assert [f.check for f in grades.findings] == ["exactness"]
    why = dict(grades.not_used)
    assert set(why) == {"recall", "logprob"}
    assert "decode-region hit" in why["recall"]
    assert "reference server" in why["logprob"]
    assert merge(grades.findings).status is Status.PASS


def test_a_grader_named_explicitly_stays_unknown_without_evidence() -> None:
    grades = graders.grade(exactness_only(), Grading(graders=("exactness", "logprob")))
    assert grades.used == ("exactness", "logprob")
    assert grades.not_used == ()
    assert [f.status for f in grades.findings] == [Status.PASS, Status.UNKNOWN]
    verdict = merge(grades.findings)
    assert (verdict.status, verdict.exit_code) == (Status.UNKNOWN, 2)


@pytest.mark.parametrize("named", [(), ("exactness", "recall")])
def test_a_crashing_grader_is_unknown_never_pass(monkeypatch: pytest.MonkeyPatch, named: tuple[str, ...]) -> None:
    def crash(history: History, grading: Grading) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(graders.GRADER_FUNCTIONS, "recall", crash)
    grades = graders.grade(exactness_only(), Grading(graders=named))
    crashed = next(f for f in grades.findings if f.check == "recall")
    assert crashed.status is Status.UNKNOWN
    assert "grader crashed: ZeroDivisionError" in crashed.reason
    # The other grader passed; the crash must still keep the run from PASS, in auto mode too.
    assert merge(grades.findings).status is Status.UNKNOWN


def test_a_run_where_every_grader_lacks_evidence_is_no_evidence() -> None:
    history = h.history([h.plan(0)], h.resumed(0, Arm.TREATMENT, cached=0))
    grades = graders.grade(history, GRADING)
    assert grades.used == ()
    [finding] = grades.findings
    assert finding.check == "graders"
    assert finding.error_class == "NoEvidence"
    for name in ("exactness", "recall", "logprob"):
        assert f"{name}: " in finding.reason
    assert merge(grades.findings).exit_code == 2


def test_a_failing_grader_is_kept_in_auto_mode() -> None:
    grades = graders.grade(recall_history([(False, True)] * 8 + [(True, True)] * 4), GRADING)
    assert "recall" in grades.used
    assert merge(grades.findings).status is Status.FAIL
