"""The preemption probe's trigger proof (both arms preempted while their turn 1s ran, no recomputation preempted)
and grader (each turn 1 against its recomputation over the whole answer), on hand-built histories."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from blackbox import gates, graders
from blackbox.config import Grading
from blackbox.history import Arm, Exchange, History
from blackbox.probes import preemption
from blackbox.verdict import Status, merge

import histories as h

GRADING = Grading()
PROBES = ("preemption",)
HELD, YARDSTICK = 16, 32
ANSWER = 12  # positions of each turn 1: the grader must look past the first few
WINDOWS: Mapping[str, Mapping[str, float | None]] = {
    Arm.TREATMENT: {"preemptions": 9.0, "recompute_preemptions": 0.0},
    Arm.REFERENCE: {"preemptions": 14.0, "recompute_preemptions": 0.0},
}


def answer(noise: float, *, wrong_from: int | None = None) -> tuple[Any, ...]:
    """A turn 1's positions: `noise` off the recomputation's at each, and from `wrong_from` on other tokens that
    recomputation was sure of (a resume from a wrong state)."""
    words = [f"w{i}" if wrong_from is None or i < wrong_from else f"x{i}" for i in range(ANSWER)]
    return h.tokens(*(-0.1 - noise * (i % 3) for i in range(ANSWER)), words=words)


def chain(prefix: int, arm: str, noise: float, wrong_from: int | None) -> list[Exchange]:
    return [
        h.exchange(prefix, arm, preemption.TURN1, cached=0, toks=answer(noise, wrong_from=wrong_from)),
        h.exchange(prefix, arm, preemption.AGAIN, cached=0, toks=answer(0.0)),
        h.exchange(prefix, arm, preemption.FOLLOW, cached=h.DECODE_HIT, toks=h.tokens(-0.1)),
    ]


def preempt_history(
    wrong_from: Sequence[int | None] | None = None,
    *,
    windows: Mapping[str, Mapping[str, float | None]] = WINDOWS,
    reference: bool = True,
) -> History:
    wrong = list(wrong_from) if wrong_from is not None else [None] * HELD
    first = preemption.FIRST
    exchanges = [
        e
        for i, w in enumerate(wrong)
        for e in chain(first + i, Arm.TREATMENT, 0.001 * (i % 5), w)  # a correct engine's small noise
    ]
    if reference:
        exchanges += [e for i in range(YARDSTICK) for e in chain(first + i, Arm.REFERENCE, 0.001 * ((i + 2) % 5), None)]
    rows = [{"index": first + i, "prompt_tokens": h.PROMPT} for i in range(YARDSTICK)]
    shown = {arm: dict(w) for arm, w in windows.items() if reference or arm == Arm.TREATMENT}
    data = {"held": rows[:HELD], "yardstick": rows[HELD:], "windows": shown}
    base = h.history([], exchanges, {Arm.TREATMENT: h.live_delta()})
    return dataclasses.replace(base, extras={preemption.Preemption.name: data})


def verdict(history: History) -> tuple[Status, str | None]:
    found = [*gates.all_gates(history, GRADING, PROBES), *graders.grade(history, GRADING, PROBES).findings]
    v = merge(found)
    return v.status, v.error_class


def gate(history: History) -> Any:
    [finding] = preemption.PREEMPTION.gates(history, GRADING)
    assert finding.check == "preempt-trigger"
    return finding


def test_answers_written_under_preemption_that_match_their_recomputation_pass_saying_what_cannot_be_seen() -> None:
    history = preempt_history()
    assert verdict(history) == (Status.PASS, None)
    found = gate(history)
    assert "preempted 9 times while its 16 turn 1s ran (the reference 14 times)" in found.reason
    assert "cannot be seen over HTTP" in found.reason
    assert found.figures["follow_up_hits"] == HELD  # the follow-ups on the recomputations' salts hit: cache live
    [graded] = graders.grade(history, GRADING, PROBES).findings
    assert graded.figures["compared_positions"] == "whole answer"


def test_answers_that_went_wrong_late_fail_only_because_the_whole_answer_is_compared() -> None:
    """A preempted request resumes at a position nobody outside can see: here the last 3 of 12 tokens of 6 answers
    are other tokens, past every position the follow-up graders compare (2 + speculative tokens)."""
    wrong: list[int | None] = [ANSWER - 3] * 6 + [None] * (HELD - 6)
    history = preempt_history(wrong)
    assert verdict(history) == (Status.FAIL, "CorruptionDetected")
    [graded] = graders.grade(history, GRADING, PROBES).findings
    assert {m["unit"] for m in graded.figures["mismatches"]} == {preemption.FIRST + i for i in range(6)}


@pytest.mark.parametrize(
    ("windows", "said", "hint"),
    [
        (
            {**WINDOWS, Arm.TREATMENT: {"preemptions": 0.0, "recompute_preemptions": 0.0}},
            "the treatment preempted no request (0)",
            "cpu-tiny-preempt",
        ),
        (
            {**WINDOWS, Arm.TREATMENT: {"preemptions": None, "recompute_preemptions": None}},
            "the treatment preempted no request (not published)",
            "cpu-tiny-preempt",
        ),
        (
            {**WINDOWS, Arm.REFERENCE: {"preemptions": 0.0, "recompute_preemptions": 0.0}},
            "the reference preempted no request",
            "the treatment's small KV cache",
        ),
        (
            {**WINDOWS, Arm.REFERENCE: {"preemptions": 14.0, "recompute_preemptions": 2.0}},
            "the recomputations were preempted themselves ({'reference': 2.0})",
            "holds 2 turn 1s at once",
        ),
    ],
    ids=["no-preemption", "unpublished", "reference-not-preempted", "recomputation-preempted"],
)
def test_a_run_that_did_not_preempt_both_arms_cleanly_is_unknown_even_where_answers_differ(
    windows: Mapping[str, Mapping[str, float | None]], said: str, hint: str
) -> None:
    history = preempt_history([0] * HELD, windows=windows)  # every answer wrong, yet not FAIL
    found = gate(history)
    assert found.error_class == "TriggerNotExercised" and said in found.reason, found.reason
    assert hint in found.hint
    assert verdict(history) == (Status.UNKNOWN, "TriggerNotExercised")


def test_without_a_reference_the_grader_has_no_evidence() -> None:
    history = preempt_history(reference=False)
    assert gate(history).status is Status.PASS  # the treatment alone was preempted: nothing to say of a reference
    [finding] = graders.grade(history, GRADING, PROBES).findings
    assert finding.error_class == "NoEvidence" and "reference" in finding.reason
    assert verdict(history)[0] is Status.UNKNOWN


def test_a_turn_1_or_recomputation_that_failed_is_left_out_not_graded_as_exact() -> None:
    history = preempt_history()
    broken = h.exchange(preemption.FIRST, Arm.TREATMENT, preemption.AGAIN, error="500")
    kept = [
        e
        for e in history.exchanges
        if (e.conversation, e.arm, e.kind) != (broken.conversation, broken.arm, broken.kind)
    ]
    samples = preemption._samples(dataclasses.replace(history, exchanges=(*kept, broken)), Arm.TREATMENT, 1.0, 4)
    assert preemption.FIRST not in {s.unit for s in samples} and len(samples) == HELD - 1
