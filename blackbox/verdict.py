"""Three-valued judgements and how they merge.

A `Finding` is one gate's or one grader's judgement; a `Verdict` merges them. FAIL beats ERROR beats UNKNOWN
beats PASS, so one piece of evidence of corruption is never hidden by a gate that failed elsewhere, and a run
with no PASS finding at all is never PASS.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
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
            "figures": dict(self.figures),
        }


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
    """The worst finding decides; no findings at all is UNKNOWN (`NoEvidence`), never PASS."""
    found = tuple(findings)
    if not found:
        return Verdict(Status.UNKNOWN, "no check produced a finding", "NoEvidence", found, 2)
    worst = max(found, key=lambda f: f.status.rank)
    exit_code = _EXIT.get(worst.status) or _error_exit(worst)
    if worst.status is Status.PASS:
        return Verdict(Status.PASS, "every check passed: " + ", ".join(f.check for f in found), None, found, 0)
    return Verdict(worst.status, f"{worst.check}: {worst.reason}", worst.error_class, found, exit_code, worst.hint)


def _error_exit(finding: Finding) -> int:
    cls = getattr(errors, finding.error_class or "", None)
    return cls.exit_code if isinstance(cls, type) and issubclass(cls, errors.BlackboxError) else 4
