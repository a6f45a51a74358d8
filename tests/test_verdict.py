"""Merging findings: the worst wins, nothing is PASS by default, and each class has its exit code."""

from __future__ import annotations

import itertools
import json

import pytest

from blackbox import errors
from blackbox.verdict import Finding, Status, merge

PASS = Finding.passed("cache-live", "1200 tokens hit", hit_tokens=1200)
UNKNOWN = Finding.from_error("trigger", errors.TriggerNotExercised("no decode-region hit", hint="keep checkpoints"))
ERROR = Finding.from_error("endpoints", errors.EndpointError("3 of 24 requests failed"))
FAIL = Finding.from_error("exactness", errors.CorruptionDetected("1 of 4 prefill-region hits differ"))


@pytest.mark.parametrize("order", list(itertools.permutations([PASS, UNKNOWN, ERROR, FAIL])))
def test_fail_beats_error_beats_unknown_beats_pass_in_any_order(order: tuple[Finding, ...]) -> None:
    verdict = merge(order)
    assert verdict.status is Status.FAIL
    assert verdict.exit_code == 1
    assert verdict.error_class == "CorruptionDetected"
    assert verdict.reason.startswith("exactness: ")
    assert verdict.findings == order


@pytest.mark.parametrize(
    ("findings", "status", "exit_code"),
    [
        ([PASS, ERROR, UNKNOWN], Status.ERROR, 4),
        ([UNKNOWN, PASS, ERROR], Status.ERROR, 4),
        ([PASS, UNKNOWN], Status.UNKNOWN, 2),
        ([UNKNOWN, PASS], Status.UNKNOWN, 2),
        ([PASS, PASS], Status.PASS, 0),
    ],
)
def test_the_worst_finding_decides(findings: list[Finding], status: Status, exit_code: int) -> None:
    verdict = merge(findings)
    assert (verdict.status, verdict.exit_code) == (status, exit_code)


def test_no_findings_is_unknown_no_evidence_never_pass() -> None:
    verdict = merge([])
    assert verdict.status is Status.UNKNOWN
    assert verdict.error_class == "NoEvidence"
    assert verdict.exit_code == 2
    assert merge(iter(())).status is Status.UNKNOWN


def test_pass_reason_lists_every_check() -> None:
    other = Finding.passed("trigger", "4 of 4 hits reached decode-written blocks")
    verdict = merge([PASS, other])
    assert verdict.error_class is None
    assert verdict.reason == "every check passed: cache-live, trigger"


INCONCLUSIVE = [
    errors.CacheNotLive,
    errors.TriggerNotExercised,
    errors.SpecDecodeNotEngaged,
    errors.ControlQualityFailure,
    errors.GeometryUnsupported,
    errors.CounterReset,
    errors.NoEvidence,
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
    verdict = merge([PASS, Finding.from_error("check", cls("went wrong", hint="do this"))])
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
    assert [f["check"] for f in data["findings"]] == ["cache-live", "exactness"]
    assert data["findings"][0]["figures"] == {"hit_tokens": 1200}
    assert data["findings"][1]["error_class"] == "CorruptionDetected"
