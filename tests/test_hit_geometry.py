"""The hit-geometry sweep's gate and grader on hand-built histories (blocks of 16 tokens)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from blackbox import gates, graders
from blackbox.config import Grading
from blackbox.history import Arm, History
from blackbox.probes import hit_geometry as geo
from blackbox.server_info import ServerInfo
from blackbox.verdict import Status, merge

import histories as h

GRADING = Grading()
PROBES = ("hit-geometry",)
B = h.BLOCK


def test_the_ceiling_is_every_full_block_but_the_last_token_less_the_drafters_drop() -> None:
    assert geo.offsets(16) == (1, 2, 4, 8, 12, 15)
    assert [geo.ceiling(n, 16, 1) for n in (32, 33, 48, 49)] == [0, 16, 16, 32]
    assert [geo.ceiling(n, 16, 0) for n in (16, 17, 33)] == [0, 16, 32]


def sweep_history(hit: Callable[[int, int], int | None], *, deviation: float = 0.0, reference: bool = True) -> History:
    """One prompt per (multiple, offset); the repeat hits `hit(length, ceiling)` tokens and deviates `deviation`
    nats from its cold first send on the treatment (a little noise on the reference)."""
    rows, exchanges = [], []
    for i, (k, o) in enumerate((k, o) for k in geo.MULTIPLES for o in geo.offsets(B)):
        index, length = geo.FIRST + i, k * B + o
        rows.append({"index": index, "multiple": k, "offset": o, "prompt_tokens": length})
        cap = geo.ceiling(length, B, 1)
        for arm, dev, cached in ((Arm.TREATMENT, deviation, hit(length, cap)), (Arm.REFERENCE, 0.01 * (i % 5), cap)):
            if arm == Arm.REFERENCE and not reference:
                continue
            exchanges += [
                h.exchange(index, arm, geo.FIRST_SEND, cached=0, toks=h.tokens(-0.1, -0.2)),
                h.exchange(index, arm, geo.REPEAT, cached=cached, toks=h.tokens(-0.1 - dev, -0.2)),
            ]
    base = h.history([], exchanges, {Arm.TREATMENT: h.live_delta()})
    return dataclasses.replace(base, extras={geo.HitGeometry.name: {"prompts": rows}})


def gate(history: History) -> tuple[Status, str | None, dict[str, object]]:
    [finding] = geo.HIT_GEOMETRY.gates(history, GRADING)
    return finding.status, finding.error_class, finding.figures


def test_hits_at_every_offset_pass_the_gate_and_the_grader() -> None:
    history = sweep_history(lambda length, cap: cap)
    status, error, figures = gate(history)
    assert (status, error) == (Status.PASS, None)
    assert figures["offsets_dead"] == [] and figures["drop_blocks"] == 1
    found = [*gates.all_gates(history, GRADING, PROBES), *graders.grade(history, GRADING, PROBES).findings]
    assert merge(found).status is Status.PASS


def test_an_offset_class_that_never_hits_is_named() -> None:
    history = sweep_history(lambda length, cap: 0 if length % B in (1, 2) else cap)
    status, error, figures = gate(history)
    assert (status, error) == (Status.UNKNOWN, "CacheNotLive")
    assert figures["offsets_dead"] == [1, 2]
    [finding] = geo.HIT_GEOMETRY.gates(history, GRADING)
    assert "ending [1, 2] tokens past a block boundary hit nothing" in finding.reason


def test_an_offset_class_that_hits_at_some_multiples_is_not_dead() -> None:
    history = sweep_history(lambda length, cap: cap if length > 2 * B + 1 else 0)  # offset 1 misses at 2 blocks only
    assert gate(history)[2]["offsets_dead"] == []


@pytest.mark.parametrize(
    ("hit", "error"), [(lambda n, c: 0, "CacheNotLive"), (lambda n, c: None, "TriggerNotExercised")]
)
def test_a_sweep_that_never_hits_or_never_reports_is_unknown(hit: Callable[[int, int], int | None], error: str) -> None:
    assert gate(sweep_history(hit))[:2] == (Status.UNKNOWN, error)


def test_hits_that_deviate_from_their_cold_send_beyond_the_reference_fail() -> None:
    history = sweep_history(lambda length, cap: cap, deviation=2.0)
    [finding] = graders.grade(history, GRADING, PROBES).findings
    assert (finding.check, finding.error_class) == ("sweep-exactness", "CorruptionDetected")
    assert graders.grade(sweep_history(lambda n, c: c, reference=False), GRADING, PROBES).findings[0].error_class == (
        "NoEvidence"
    )


def drafted_history(*, treatment_dev: float, budget: int | None, published: bool = False) -> History:
    """Repeats as a speculating treatment and a reference give them: the treatment hits one block less (the drafter's
    drop), so it recomputes a tail of a block and the offset, the reference the offset alone. A correct engine that
    is not bit-exact differs from its cold send where the step budget cuts a tail (`treatment_dev` on every
    treatment repeat, 0.03 on the reference's cut ones) and is exact elsewhere."""
    rows, exchanges = [], []
    for i, (k, o) in enumerate((k, o) for k in geo.MULTIPLES for o in geo.offsets(B)):
        index, length = geo.FIRST + i, k * B + o
        rows.append({"index": index, "multiple": k, "offset": o, "prompt_tokens": length})
        cap = geo.ceiling(length, B, 1)
        cut_reference = budget is not None and o > budget
        for arm, cached, dev in (
            (Arm.TREATMENT, cap, treatment_dev),
            (Arm.REFERENCE, cap + B, 0.03 + 0.001 * i if cut_reference else 0.0),
        ):
            cold = h.exchange(index, arm, geo.FIRST_SEND, cached=0, toks=h.tokens(-0.1, -0.2))
            repeat = h.exchange(index, arm, geo.REPEAT, cached=cached, toks=h.tokens(-0.1 - dev, -0.2))
            exchanges += [dataclasses.replace(e, prompt_tokens=length) for e in (cold, repeat)]
    base = h.history([], exchanges, {Arm.TREATMENT: h.live_delta()})
    info = ServerInfo("http://t", "0.32.0", {"max_num_batched_tokens": str(budget)}) if published else None
    return dataclasses.replace(
        base,
        extras={geo.HitGeometry.name: {"prompts": rows}},
        step_budget=None if published else budget,
        treatment_info=info,
    )


@pytest.mark.parametrize("published", [False, True], ids=["stated", "published"])
def test_repeats_whose_tail_the_step_budget_cuts_are_not_graded(published: bool) -> None:
    """A correct engine chunked mid-block (budget 12 here; 96 on cpu-tiny-fragmented): every treatment tail is cut,
    most reference tails are not. Graded together this read CorruptionDetected on a correct engine (2 of 2 clean
    cpu-tiny-fragmented runs); now those repeats are named and not graded, and with none left the run is UNKNOWN."""
    history = drafted_history(treatment_dev=0.05, budget=12, published=published)
    [finding] = graders.grade(history, GRADING, PROBES).findings
    assert (finding.check, finding.error_class) == ("sweep-exactness", "NoEvidence")
    assert "18 treatment and 3 reference repeats whose recomputed tail the step budget (12 tokens) cuts" in (
        finding.reason
    )
    found = [*gates.all_gates(history, GRADING, PROBES), *graders.grade(history, GRADING, PROBES).findings]
    assert merge(found).status is Status.UNKNOWN


def test_with_every_tail_inside_one_step_a_corrupt_repeat_still_fails() -> None:
    history = drafted_history(treatment_dev=2.0, budget=64)
    [finding] = graders.grade(history, GRADING, PROBES).findings
    assert (finding.check, finding.error_class) == ("sweep-exactness", "CorruptionDetected")
    assert finding.figures["step_budget"] == 64 and finding.figures["cut_tails"] == {"treatment": 0, "reference": 0}
