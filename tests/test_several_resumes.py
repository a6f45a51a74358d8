"""Several resumes a conversation (`--resumes`): where the cuts fall, and the logprob grader scoring each
conversation by its largest decode-region deviation, on hand-built histories and by simulation under the null."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

from blackbox import graders, sequential
from blackbox.config import RunConfig
from blackbox.errors import UsageError
from blackbox.history import Arm, Exchange, History, Kind
from blackbox.probes import multiturn
from blackbox.verdict import Finding, Status, Verdict, merge
from blackbox.workload import MAX_RESUMES, Shape, resume_cut

import histories as h
from nulls import fails

ALPHA = 0.01
GRADING = graders.Grading(alpha=ALPHA)
NOISE = 0.0005  # a correct engine's deviation from recomputation, first-token logprob shift in nats


def test_each_extra_resume_lengthens_turn_1_by_a_block_and_cuts_a_block_earlier() -> None:
    one, three = Shape(), Shape(resumes=3)
    assert three.turn1_tokens(16) == one.turn1_tokens(16) + 2 * 16
    # the whole answer ends half a block past a boundary, and so does every cut, a block apart
    assert three.resume_cuts(16) == (three.turn1_tokens(16) - 16, three.turn1_tokens(16) - 32)
    assert one.resume_cuts(16) == ()


@pytest.mark.parametrize(
    ("text", "tokens", "keep", "cut"),
    [
        # word-level tokens (the tiny model's), which the detokenizer joins with spaces
        ("alpha bravo charlie delta", ["alpha", "bravo", "charlie", "delta"], 2, "alpha bravo"),
        # byte-level BPE tokens carry their own leading space
        ("the code is red", ["the", " code", " is", " red"], 3, "the code is"),
        # sentencepiece marks a word start with U+2581
        ("the code is red", ["\u2581the", "\u2581code", "\u2581is", "\u2581red"], 1, "the"),
        ("alpha bravo", ["alpha", "bravo"], 2, "alpha bravo"),
        # tokens that cannot be followed along the text: the same share of the text
        ("abcdefgh", ["zz", "yy", "xx", "ww"], 2, "abcd"),
    ],
)
def test_a_cut_keeps_the_answers_first_tokens(text: str, tokens: list[str], keep: int, cut: str) -> None:
    assert resume_cut(text, tokens, keep) == cut


@pytest.mark.parametrize("resumes", [0, MAX_RESUMES + 1])
def test_a_resume_count_out_of_range_is_a_usage_error_naming_the_flag(resumes: int) -> None:
    with pytest.raises(UsageError, match="--resumes"):
        RunConfig(treatment="http://127.0.0.1:1", shape=Shape(resumes=resumes))


def _arm(conv: int, arm: str, shifts: Sequence[float | None]) -> list[Exchange]:
    """One conversation's turn 2 and extra resumes on `arm`, each hit `shift` nats off its recomputation at the
    first token (None: that resume's hit stopped in the prompt, so it is not a decode-region resume)."""
    out = [h.exchange(conv, arm, Kind.TURN1, cached=0, text="a long story")]
    for j, shift in enumerate(shifts):
        kind = Kind.TURN2 if j == 0 else Kind.resume(j)
        fresh = h.tokens(-0.5, -0.2, -0.1)
        hit = h.tokens(-0.5 - (shift or 0.0), -0.2, -0.1)
        cached = h.PROMPT_HIT if shift is None else h.DECODE_HIT
        out += [
            h.exchange(conv, arm, kind, cached=cached, toks=hit, text=h.ANSWER),
            h.exchange(conv, arm, Kind.fresh(kind), cached=0, toks=fresh, text=h.ANSWER),
        ]
    return out


def _history(treatment: Sequence[Sequence[float | None]], reference: Sequence[Sequence[float | None]]) -> History:
    n = len(treatment)
    exchanges = [e for i, row in enumerate(treatment) for e in _arm(i, Arm.TREATMENT, row)]
    exchanges += [e for i, row in enumerate(reference) for e in _arm(i, Arm.REFERENCE, row)]
    plans = [h.plan(i) for i in range(len(reference))]
    return dataclasses.replace(h.history(plans[:n], exchanges), yardstick=tuple(plans[n:]))


def _noise(i: int, j: int) -> float:
    return NOISE * (1 + ((7 * i + 3 * j) % 11) / 10)


def _clean(n: int, resumes: int = 3, base: int = 0) -> list[list[float | None]]:
    return [[_noise(base + i, j) for j in range(resumes)] for i in range(n)]


def _turn2_only(history: History) -> History:
    kept = tuple(e for e in history.exchanges if not e.kind.startswith(Kind.RESUME))
    return dataclasses.replace(history, exchanges=kept)


def test_corruption_of_one_boundary_in_three_is_seen_by_the_maxima_and_missed_by_turn_2_alone() -> None:
    # A block-shaped sporadic fault: in 8 of 12 conversations the boundary the second extra resume lands on is
    # corrupt, and turn 2's own boundary is not. Turn 2 alone sees nothing; the maxima see 8 of 12 beyond every
    # reference conversation's largest: C(12, 8) / C(36, 8), far below alpha / 3.
    treatment = _clean(12)
    for row in treatment[:8]:
        row[2] = 0.05
    history = _history(treatment, _clean(24, base=100))
    assert multiturn.resume_kinds(history) == (Kind.TURN2, "resume1", "resume2")

    finding = graders.logprob(history, GRADING)
    assert finding.error_class == "CorruptionDetected", finding.reason
    assert (finding.figures["n_subject"], finding.figures["n_yardstick"]) == (12, 24)
    assert finding.figures["resumes_per_conversation"] == 3
    assert "treatment conversations (each its largest deviation over 3 decode-region resumes)" in finding.reason
    assert {m["unit"] for m in finding.figures["mismatches"]} == set(range(8))
    assert {m["kind"] for m in finding.figures["mismatches"]} == {"resume2"}

    alone = graders.logprob(_turn2_only(history), GRADING)
    assert alone.status is Status.PASS, alone.reason
    assert "resumes_per_conversation" not in alone.figures


def test_a_clean_run_with_several_resumes_passes_and_states_its_power_in_conversations() -> None:
    finding = graders.logprob(_history(_clean(12), _clean(24, base=100)), GRADING)
    assert finding.status is Status.PASS, finding.reason
    assert "of treatment conversations (each its largest deviation over 3 decode-region resumes)" in finding.reason
    assert finding.figures["decode_region_resumes"] == {Arm.TREATMENT: {3: 12}, Arm.REFERENCE: {3: 24}}


def _graded(finding: Finding) -> Verdict:
    return merge([dataclasses.replace(finding, stage="grader", covers_trigger=True)])


def test_a_pass_over_maxima_states_the_fraction_of_resumes_it_covers_where_boundaries_fail_independently() -> None:
    maxima = graders.logprob(_history(_clean(24), _clean(48, base=100)), GRADING)
    q = maxima.figures["detectable_fraction"]
    each = maxima.figures["detectable_fraction_of_resumes"]
    # independently at `each` per boundary, a conversation of 3 is hit with 1 - (1 - each)^3 = q
    assert 0 < each < q < 1 and 1 - (1 - each) ** 3 == pytest.approx(q)
    assert f"that is corruption in >= {each:.0%} of decode-region resumes (3 a conversation)" in maxima.reason
    assert "where they fail together only the conversation fraction holds" in maxima.reason
    # --detect (a fraction of hits) reads the per-resume figure; a one-resume run has only its hit fraction
    assert sequential.coverage(_graded(maxima)) == each
    alone = graders.logprob(_turn2_only(_history(_clean(24), _clean(48, base=100))), GRADING)
    assert "detectable_fraction_of_resumes" not in alone.figures
    assert sequential.coverage(_graded(alone)) == alone.figures["detectable_fraction"]


def test_a_budget_short_of_detect_plans_conversations_for_the_conversation_fraction_it_implies() -> None:
    # --detect 0.1 over maxima of 3 asks for 1 - 0.9^3 = 27% of conversations, not 10%: far fewer conversations.
    maxima = _graded(graders.logprob(_history(_clean(24), _clean(48, base=100)), GRADING))
    one = dataclasses.replace(
        maxima,
        findings=tuple(
            dataclasses.replace(f, figures={**f.figures, "resumes_per_conversation": 1}) for f in maxima.findings
        ),
    )
    last = sequential.Look(1, 24, ALPHA, Status.PASS, None, None, stop=False)
    over_three, over_one = sequential._more(maxima, 0.1, last), sequential._more(one, 0.1, last)
    assert over_three is not None and over_one is not None
    assert over_three < over_one / 2


def test_reference_conversations_with_fewer_resumes_leave_the_yardstick_treatment_ones_stay() -> None:
    # Two reference conversations lost a resume to the prompt region: their maxima are over fewer draws (a
    # lower bar), so they leave the yardstick. A treatment conversation with fewer keeps a conservative score.
    reference = _clean(24, base=100)
    reference[20][1] = reference[22][2] = None
    treatment = _clean(12)
    treatment[3][0] = treatment[3][1] = None
    m = multiturn.resume_maxima(_history(treatment, reference), 1.0, None)
    assert m.per == 3
    assert m.left_out == [20, 22]
    assert len(m.reference) == 22 and len(m.treatment) == 12
    assert m.counts[Arm.TREATMENT] == {1: 1, 3: 11}
    scored = {s.unit: s for s in m.treatment}
    assert scored[3].label == "resume2"


def test_the_count_most_reference_conversations_reach_decides_the_maxima_length() -> None:
    # Most reference conversations resumed twice in the decode region: every conversation is scored over its
    # first two, and a treatment conversation's third (where the fault is) is not looked at.
    reference = [[*row[:2], None] for row in _clean(24, base=100)]
    treatment = _clean(12)
    for row in treatment:
        row[2] = 0.05
    finding = graders.logprob(_history(treatment, reference), GRADING)
    assert finding.figures["resumes_per_conversation"] == 2
    assert finding.status is Status.PASS, finding.reason


def test_a_run_in_rounds_keeps_each_conversations_extra_resumes_with_it() -> None:
    history = _history(_clean(12), _clean(12, base=100))
    first = sequential.subset(history, sequential.Schedule(round=4, maximum=12, alpha=ALPHA), 4)
    kinds = {(e.conversation, e.kind) for e in first.exchanges}
    assert (3, "resume2-fresh") in kinds
    assert not any(c >= 4 for c, _ in kinds)


def test_maxima_with_the_reference_cut_to_full_counts_keep_the_level_under_the_null() -> None:
    # Null: every resume's deviation is one draw of the same law on both arms. The treatment's checkpoints are
    # patchy (1-3 decode-region resumes a conversation, as under MTP); the reference resumes 3 times except in a
    # fifth of its conversations (2). The rule scores everything over 3, leaves the reference's short ones out,
    # and keeps the treatment's. 20 000 runs of 32 against 64: FAIL rate at or below alpha. Keeping the short
    # reference conversations in (a lower yardstick) is what the rule exists to prevent; it is measured too.
    rng = np.random.default_rng(28)
    runs, n_t, n_r, r = 20_000, 32, 64, 3
    draws_t = np.abs(rng.normal(size=(runs, n_t, r)))
    counts_t = rng.integers(1, r + 1, size=(runs, n_t))
    x = np.where(np.arange(r)[None, None, :] < counts_t[:, :, None], draws_t, 0.0).max(axis=2)
    y_full = np.abs(rng.normal(size=(runs, n_r, r))).max(axis=2)
    rate = fails(x, y_full, ALPHA).mean()
    assert rate <= ALPHA, rate  # 0 measured: maxima spread less, and the thresholds sit at 1.25x

    # Why the length is the reference's: where most reference conversations resumed once in the decode region,
    # a treatment scored over all three of its resumes stands above a yardstick of single draws in every run
    # in nearly half the runs, with no fault at all. The rule scores both over one there (the single-resume test).
    y_single = np.abs(rng.normal(size=(runs, n_r)))
    too_long = fails(draws_t.max(axis=2), y_single, ALPHA).mean()
    assert too_long > 0.3, too_long  # 0.45 measured
    patchy = fails(x, y_single, ALPHA).mean()  # even with the treatment's patchy counts: 0.033 measured
    assert patchy > 2 * ALPHA, patchy
    assert fails(draws_t[:, :, 0], y_single, ALPHA).mean() <= ALPHA
