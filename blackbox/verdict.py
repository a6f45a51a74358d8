"""Three-valued judgements and the one rule that merges them into a verdict.

A `Finding` is one gate's or one grader's judgement. The verdict rule (`merge`):

1. Gates first. If any gate failed (an endpoint, a role or comparability check, a counter reset, a cache or a
   trigger not proven), the verdict is the worst failed gate (ERROR before UNKNOWN) and no grader counts: a
   grader's FAIL on a run whose premises failed is not evidence of corruption.
2. FAIL (exit 1) only when every gate passed and a grader found corruption.
3. Otherwise the worst grader finding that is not PASS (a grader asked for by name without evidence, or a crash).
4. PASS only when every gate passed, every grader used passed, and at least one of them judged the hits the
   trigger proved (blocks written during speculative decode, or by a fragmented race) with the power to fail.
   Anything else is UNKNOWN (`NoEvidence`).
5. A PASS or FAIL names what a passed gate could only assume (its `caveat`: a setting neither server published).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from blackbox import errors

__all__ = ["Finding", "Status", "Verdict", "merge"]


class Status(str, enum.Enum):
    PASS = "PASS"
    UNKNOWN = "UNKNOWN"
    ERROR = "ERROR"
    FAIL = "FAIL"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Status.PASS: 0, Status.UNKNOWN: 1, Status.ERROR: 2, Status.FAIL: 3}
_EXIT = {Status.PASS: 0, Status.FAIL: 1, Status.UNKNOWN: 2}


@dataclass(frozen=True)
class Finding:
    """One check's judgement. `error_class` names the `blackbox.errors` class for anything but PASS."""

    check: str
    status: Status
    reason: str
    figures: Mapping[str, Any] = field(default_factory=dict)
    error_class: str | None = None
    hint: str = ""  # what to do next
    stage: str = "gate"  # "gate": a premise of the run; "grader": a judgement of its outputs
    covers_trigger: bool = False  # a grader that judged the hits the trigger gate proved

    @classmethod
    def passed(cls, check: str, reason: str, **figures: Any) -> Finding:
        return cls(check, Status.PASS, reason, figures)

    @classmethod
    def from_error(cls, check: str, error: errors.BlackboxError, **figures: Any) -> Finding:
        status = (
            Status.FAIL
            if isinstance(error, errors.CorruptionDetected)
            else Status.UNKNOWN
            if isinstance(error, errors.Inconclusive)
            else Status.ERROR
        )
        return cls(check, status, error.message, figures, error.title, error.hint)

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "status": self.status.value,
            "reason": self.reason,
            "error_class": self.error_class,
            "hint": self.hint,
            "stage": self.stage,
            "covers_trigger": self.covers_trigger,
            "figures": dict(self.figures),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Finding:
        return cls(
            data["check"],
            Status(data["status"]),
            data["reason"],
            dict(data.get("figures") or {}),
            data.get("error_class"),
            data.get("hint", ""),
            data.get("stage", "gate"),
            bool(data.get("covers_trigger", False)),
        )


@dataclass(frozen=True)
class Verdict:
    status: Status
    reason: str
    error_class: str | None
    findings: tuple[Finding, ...]
    exit_code: int
    hint: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "reason": self.reason,
            "error_class": self.error_class,
            "exit_code": self.exit_code,
            "hint": self.hint,
            "findings": [f.to_json() for f in self.findings],
        }


def merge(findings: Iterable[Finding]) -> Verdict:
    """The verdict rule of the module docstring."""
    found = tuple(findings)
    gates = [f for f in found if f.stage != "grader"]
    graders = [f for f in found if f.stage == "grader"]
    failed_gates = [f for f in gates if f.status is not Status.PASS]
    if failed_gates:
        return _from(max(failed_gates, key=lambda f: f.status.rank), found)
    failed = [f for f in graders if f.status is not Status.PASS]
    if failed:
        return _with_caveats(_from(max(failed, key=lambda f: f.status.rank), found), gates)
    covering = [f for f in graders if f.covers_trigger]
    if not covering:
        why = (
            "no grader ran"
            if not graders
            else f"{', '.join(f.check for f in graders)} judged no hit the trigger proved (decode-written blocks)"
        )
        return Verdict(
            Status.UNKNOWN,
            f"every gate passed, but {why}: this run could not have seen the corruption it looks for",
            "NoEvidence",
            found,
            2,
            "add --reference (the treatment's flags without speculative decoding) for the logprob grader, or use "
            "a model that recalls needles for the recall grader",
        )
    statement = "; ".join(f"{f.check}: {f.reason}" for f in covering)
    return _with_caveats(Verdict(Status.PASS, f"every gate passed; {statement}", None, found, 0), gates)


def _with_caveats(verdict: Verdict, gates: Iterable[Finding]) -> Verdict:
    """A PASS or FAIL repeats what its gates could only assume (figure `caveat`): it is part of its evidence."""
    if verdict.status not in (Status.PASS, Status.FAIL):
        return verdict
    caveats = [str(f.figures["caveat"]) for f in gates if f.figures.get("caveat")]
    if not caveats:
        return verdict
    return replace(verdict, reason=f"{verdict.reason} (caveat: {'; '.join(caveats)})")


def _from(worst: Finding, found: tuple[Finding, ...]) -> Verdict:
    exit_code = _EXIT.get(worst.status) or _error_exit(worst)
    return Verdict(worst.status, f"{worst.check}: {worst.reason}", worst.error_class, found, exit_code, worst.hint)


def _error_exit(finding: Finding) -> int:
    cls = getattr(errors, finding.error_class or "", None)
    return cls.exit_code if isinstance(cls, type) and issubclass(cls, errors.BlackboxError) else 4
