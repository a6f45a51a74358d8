"""Every way a blackbox run can end other than PASS.

    BlackboxError
    ├── CorruptionDetected        FAIL: the treatment answered worse than its reference (exit 1)
    ├── Inconclusive              UNKNOWN: a gate failed, nothing was tested (exit 2)
    │   ├── CacheNotLive              the prefix-cache hit counter never moved
    │   ├── TriggerNotExercised       hits never reached blocks written during speculative decode
    │   ├── SpecDecodeNotEngaged      the drafter proposed or accepted nothing
    │   ├── ControlQualityFailure     the control cannot do the task the grader needs
    │   ├── GeometryUnsupported       the conversation cannot fit the server's geometry
    │   ├── CounterReset              a counter went backwards (a server restarted mid-run)
    │   ├── NoEvidence                no grader judged the hits the trigger proved
    │   ├── InsufficientPower         a grader's sample could not have reached significance
    │   └── GraderCrashed             a grader raised (a bug of blackbox): not a verdict on the server
    ├── UsageError                ERROR: bad input or configuration (exit 3)
    │   └── ConfigMismatch            a server is not what the command says (wrong model, not vLLM, no key)
    ├── EndpointError             ERROR: a server or the network failed (exit 4)
    │   ├── ServerStartError          a launched server died or never became healthy
    │   └── DeadlineExceeded          the run did not finish within --deadline
    ├── InternalError             ERROR: an unexpected exception inside blackbox, a bug (exit 5)
    ├── StorageError              ERROR: the run folder could not be written (disk full, permissions) (exit 6)
    └── Interrupted               ERROR: SIGINT or SIGTERM stopped the run (exit 130)

A FAIL is the server under test misbehaving; UNKNOWN and ERROR are never read as PASS.
"""

from __future__ import annotations

__all__ = [
    "BlackboxError",
    "CacheNotLive",
    "ConfigMismatch",
    "ControlQualityFailure",
    "CorruptionDetected",
    "CounterReset",
    "DeadlineExceeded",
    "EndpointError",
    "GeometryUnsupported",
    "GraderCrashed",
    "Inconclusive",
    "InsufficientPower",
    "InternalError",
    "Interrupted",
    "NoEvidence",
    "ServerStartError",
    "SpecDecodeNotEngaged",
    "StorageError",
    "TriggerNotExercised",
    "UsageError",
]


class BlackboxError(Exception):
    """Base class. `hint` says what to do next; `exit_code` is the CLI's."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    @property
    def title(self) -> str:
        return type(self).__name__

    def __str__(self) -> str:
        return f"{self.message}\n  -> {self.hint}" if self.hint else self.message


class CorruptionDetected(BlackboxError):
    exit_code = 1


class Inconclusive(BlackboxError):
    exit_code = 2


class CacheNotLive(Inconclusive):
    pass


class TriggerNotExercised(Inconclusive):
    pass


class SpecDecodeNotEngaged(Inconclusive):
    pass


class ControlQualityFailure(Inconclusive):
    pass


class GeometryUnsupported(Inconclusive):
    pass


class CounterReset(Inconclusive):
    pass


class NoEvidence(Inconclusive):
    pass


class InsufficientPower(Inconclusive):
    pass


class GraderCrashed(Inconclusive):
    pass


class UsageError(BlackboxError):
    exit_code = 3


class EndpointError(BlackboxError):
    exit_code = 4


class ServerStartError(EndpointError):
    pass


class ConfigMismatch(UsageError):
    pass


class DeadlineExceeded(EndpointError):
    pass


class InternalError(BlackboxError):
    exit_code = 5


class StorageError(BlackboxError):
    exit_code = 6


class Interrupted(BlackboxError):
    exit_code = 130
