"""The whole verdict from a hand-built history (`engine.judge`): what a run can and cannot conclude."""

from __future__ import annotations

import dataclasses

from blackbox import errors
from blackbox.config import RunConfig
from blackbox.engine import judge
from blackbox.history import Arm, Exchange, History, Kind
from blackbox.verdict import Finding, Status

import histories as h

CONFIG = RunConfig(treatment="http://127.0.0.1:1", control="http://127.0.0.1:2")
N = 24
CLEAN = h.tokens(-0.1, -0.2, -0.3, -0.4)
NOISE = h.tokens(-0.11, -0.2, -0.3, -0.4)  # a decode-region hit on a correct engine: 0.01 nat off
WRONG = h.tokens(-0.1, -0.2, -0.3, -0.4, words=["x", "y", "z", "q"])  # parts at once, where recomputation was sure
ROLES = [Finding.passed("comparability", "one model"), Finding.passed("roles", "servers match their roles")]


def arm(conversation: int, which: str, hit: tuple, recalled: bool) -> list[Exchange]:
    text = h.ANSWER if recalled else "a story"
    out = h.resumed(conversation, which, hit=hit, fresh=CLEAN, text=text)
    out[2] = dataclasses.replace(out[2], text=text)  # the no-reuse answer recalls as the hit would on a clean engine
    probe = [
        h.exchange(conversation, which, Kind.PROBE, cached=h.PROMPT_HIT, toks=CLEAN),
        h.exchange(conversation, which, Kind.PROBE_FRESH, cached=0, toks=CLEAN),
    ]
    return [*out, *probe]


def run(*, hits: tuple, reference: bool, recalls: bool, **changes: float | None) -> History:
    base = h.healthy(N, **changes)
    exchanges: list[Exchange] = []
    for i in range(N):
        exchanges += arm(i, Arm.TREATMENT, hits, recalls)
        exchanges.append(h.exchange(i, Arm.CONTROL, Kind.TURN2, text=h.ANSWER if recalls else "a story"))
        if reference:
            exchanges += arm(i, Arm.REFERENCE, NOISE, recalls)
    return dataclasses.replace(base, exchanges=tuple(exchanges))


def test_corrupt_decode_region_hits_without_a_reference_or_recall_are_unknown_not_pass() -> None:
    # The review's case: every decode-region hit confidently wrong, no reference, a model that cannot recall.
    # Only prefill-region hits are judgeable, so the run could not have seen the corruption: never PASS.
    verdict, grades = judge(run(hits=WRONG, reference=False, recalls=False), CONFIG, ROLES)
    assert (verdict.status, verdict.error_class, verdict.exit_code) == (Status.UNKNOWN, "NoEvidence", 2)
    assert grades.used == ()
    assert {g for g, _ in grades.not_used} == {"exactness", "logprob", "recall"}


def test_the_same_corruption_with_a_reference_fails_by_logprob() -> None:
    verdict, grades = judge(run(hits=WRONG, reference=True, recalls=False), CONFIG, ROLES)
    assert (verdict.status, verdict.error_class, verdict.exit_code) == (Status.FAIL, "CorruptionDetected", 1)
    assert verdict.reason.startswith("logprob: ")
    assert set(grades.used) == {"exactness", "logprob"} and grades.alpha_per_grader == CONFIG.grading.alpha / 2


def test_the_same_corruption_on_a_model_that_recalls_fails_by_recall_without_a_reference() -> None:
    history = run(hits=WRONG, reference=False, recalls=True)
    hits_forget = [
        dataclasses.replace(e, text="a story") if (e.arm, e.kind) == (Arm.TREATMENT, Kind.TURN2) else e
        for e in history.exchanges
    ]
    verdict, grades = judge(dataclasses.replace(history, exchanges=tuple(hits_forget)), CONFIG, ROLES)
    assert (verdict.status, verdict.error_class) == (Status.FAIL, "CorruptionDetected")
    assert grades.used == ("recall",)


def test_a_clean_run_with_a_reference_passes_and_states_its_power() -> None:
    verdict, grades = judge(run(hits=NOISE, reference=True, recalls=False), CONFIG, ROLES)
    assert (verdict.status, verdict.exit_code) == (Status.PASS, 0)
    assert set(grades.used) == {"exactness", "logprob"}
    assert "would have been detected with probability 0.95" in verdict.reason
    logprob = next(f for f in verdict.findings if f.check == "logprob")
    assert 0 < logprob.figures["detectable_fraction"] < 1


def test_no_grader_runs_when_a_gate_failed() -> None:
    # A restart mid-run (or any failed premise) beside corrupt outputs is UNKNOWN with the gate's class, not FAIL.
    history = run(hits=WRONG, reference=True, recalls=False, CACHE_HITS=0)
    verdict, grades = judge(history, CONFIG, ROLES)
    assert (verdict.status, verdict.error_class) == (Status.UNKNOWN, "CacheNotLive")
    assert grades.findings == () and grades.used == ()
    assert not any(f.stage == "grader" for f in verdict.findings)


def test_a_stored_role_error_stays_an_error_when_regraded() -> None:
    roles = [Finding.from_error("roles", errors.UsageError("the control has prefix caching on"))]
    verdict, _ = judge(run(hits=NOISE, reference=True, recalls=False), CONFIG, roles)
    assert (verdict.status, verdict.error_class, verdict.exit_code) == (Status.ERROR, "UsageError", 3)


def test_a_handful_of_conversations_is_insufficient_power_not_pass() -> None:
    small = run(hits=NOISE, reference=True, recalls=False)
    few = dataclasses.replace(small, plans=small.plans[:3])
    verdict, grades = judge(few, CONFIG, ROLES)
    assert verdict.status is Status.UNKNOWN
    assert grades.used == ()
    assert any("cannot reach p <" in why for _, why in grades.not_used)
