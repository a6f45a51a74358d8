"""The verdict rule: gates first, FAIL only on passed gates, PASS only from a grader of the trigger's hits."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from blackbox import errors
from blackbox.verdict import Finding, Status, merge


def grader(finding: Finding, *, covers: bool = True) -> Finding:
    return dataclasses.replace(finding, stage="grader", covers_trigger=covers)


PASS = Finding.passed("cache-live", "1200 tokens hit", hit_tokens=1200)
UNKNOWN = Finding.from_error("trigger", errors.TriggerNotExercised("no decode-region hit", hint="keep checkpoints"))
ERROR = Finding.from_error("endpoints", errors.EndpointError("3 of 24 requests failed"))
RESET = Finding.from_error("counters", errors.CounterReset("a counter went backwards"))
ROLES = Finding.from_error("roles", errors.UsageError("the control has prefix caching on"))
FAIL = grader(Finding.from_error("logprob", errors.CorruptionDetected("decode-region hits deviate")))
GRADED = grader(Finding.passed("logprob", "24 hits within the reference's; detects >= 40% of hits"))
PREFILL_ONLY = grader(Finding.passed("exactness", "24 prefill-region hits within the reference's"), covers=False)
NAMED_NO_EVIDENCE = grader(Finding.from_error("recall", errors.NoEvidence("no control answers")))


@pytest.mark.parametrize("order", list(itertools.permutations([PASS, GRADED, FAIL])))
def test_a_grader_finding_corruption_fails_the_run_when_every_gate_passed(order: tuple[Finding, ...]) -> None:
    verdict = merge(order)
    assert (verdict.status, verdict.exit_code, verdict.error_class) == (Status.FAIL, 1, "CorruptionDetected")
    assert verdict.reason.startswith("logprob: ")
    assert verdict.findings == order


@pytest.mark.parametrize(
    ("gate", "status", "error_class", "exit_code"),
    [
        (UNKNOWN, Status.UNKNOWN, "TriggerNotExercised", 2),
        (RESET, Status.UNKNOWN, "CounterReset", 2),
        (ERROR, Status.ERROR, "EndpointError", 4),
        (ROLES, Status.ERROR, "UsageError", 3),
    ],
)
def test_a_failed_gate_outranks_a_grader_fail(gate: Finding, status: Status, error_class: str, exit_code: int) -> None:
    # A FAIL on a run whose premises failed (a restart, servers not in their roles) is not evidence of corruption.
    for order in itertools.permutations([PASS, gate, FAIL]):
        verdict = merge(order)
        assert (verdict.status, verdict.error_class, verdict.exit_code) == (status, error_class, exit_code)


def test_error_gates_outrank_unknown_gates() -> None:
    assert merge([UNKNOWN, ERROR, PASS, GRADED]).error_class == "EndpointError"
    assert merge([ROLES, UNKNOWN]).exit_code == 3


def test_pass_needs_a_grader_that_judged_the_trigger_hits() -> None:
    assert merge([PASS, GRADED]).status is Status.PASS
    assert merge([PASS, GRADED, PREFILL_ONLY]).status is Status.PASS
    only_prefill = merge([PASS, PREFILL_ONLY])
    assert (only_prefill.status, only_prefill.error_class, only_prefill.exit_code) == (Status.UNKNOWN, "NoEvidence", 2)
    assert "exactness judged no hit the trigger proved" in only_prefill.reason
    assert "--reference" in only_prefill.hint


def test_gates_alone_are_never_pass() -> None:
    verdict = merge([PASS, Finding.passed("trigger", "24 of 24 hits reached decode-written blocks")])
    assert (verdict.status, verdict.error_class) == (Status.UNKNOWN, "NoEvidence")
    assert "no grader ran" in verdict.reason


def test_a_grader_named_without_evidence_keeps_the_run_unknown() -> None:
    verdict = merge([PASS, GRADED, NAMED_NO_EVIDENCE])
    assert (verdict.status, verdict.error_class) == (Status.UNKNOWN, "NoEvidence")
    assert merge([PASS, GRADED, NAMED_NO_EVIDENCE, FAIL]).status is Status.FAIL


def test_no_findings_is_unknown_no_evidence_never_pass() -> None:
    verdict = merge([])
    assert verdict.status is Status.UNKNOWN
    assert verdict.error_class == "NoEvidence"
    assert verdict.exit_code == 2
    assert merge(iter(())).status is Status.UNKNOWN


def test_pass_reason_states_what_the_covering_graders_could_see() -> None:
    verdict = merge([PASS, GRADED, PREFILL_ONLY])
    assert verdict.error_class is None and verdict.exit_code == 0
    assert verdict.reason == "every gate passed; logprob: 24 hits within the reference's; detects >= 40% of hits"


def test_findings_round_trip_through_json() -> None:
    for f in (PASS, UNKNOWN, FAIL, GRADED, PREFILL_ONLY):
        assert Finding.from_json(json.loads(json.dumps(f.to_json()))) == f


INCONCLUSIVE = [
    errors.CacheNotLive,
    errors.TriggerNotExercised,
    errors.SpecDecodeNotEngaged,
    errors.ControlQualityFailure,
    errors.GeometryUnsupported,
    errors.CounterReset,
    errors.NoEvidence,
    errors.InsufficientPower,
    errors.GraderCrashed,
]


@pytest.mark.parametrize(
    ("cls", "status", "exit_code"),
    [
        (errors.CorruptionDetected, Status.FAIL, 1),
        *[(cls, Status.UNKNOWN, 2) for cls in INCONCLUSIVE],
        (errors.UsageError, Status.ERROR, 3),
        (errors.EndpointError, Status.ERROR, 4),
        (errors.ServerStartError, Status.ERROR, 4),
    ],
)
def test_each_error_class_has_its_status_and_exit_code(
    cls: type[errors.BlackboxError], status: Status, exit_code: int
) -> None:
    assert cls.exit_code == exit_code
    finding = Finding.from_error("check", cls("went wrong", hint="do this"))
    verdict = merge([PASS, GRADED, grader(finding) if cls is errors.CorruptionDetected else finding])
    assert verdict.status is status
    assert verdict.exit_code == exit_code
    assert verdict.error_class == cls.__name__
    assert verdict.hint == "do this"  # the hint travels with the finding


def test_an_error_finding_that_names_no_known_class_is_still_an_error() -> None:
    odd = Finding("setup", Status.ERROR, "something broke", {}, "NotAClass")
    assert merge([odd]).exit_code == 4


def test_error_message_and_hint() -> None:
    exc = errors.TriggerNotExercised("no hit reached decode", hint="raise --answer-blocks")
    assert str(exc) == "no hit reached decode\n  -> raise --answer-blocks"
    assert exc.title == "TriggerNotExercised"
    assert str(errors.NoEvidence("nothing")) == "nothing"


def test_verdict_is_json() -> None:
    verdict = merge([PASS, FAIL])
    data = json.loads(json.dumps(verdict.to_json()))
    assert data["status"] == "FAIL"
    assert data["exit_code"] == 1
    assert [f["check"] for f in data["findings"]] == ["cache-live", "logprob"]
    assert data["findings"][0]["figures"] == {"hit_tokens": 1200}
    assert data["findings"][1]["error_class"] == "CorruptionDetected"
