"""What happened during a run: every exchange with every server, and the counters around it.

Graders and gates read a `History` and nothing else, so each of them can be tested on a hand-built one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from blackbox.metrics import MetricsDelta
from blackbox.server_info import ServerInfo

__all__ = ["Arm", "Exchange", "History", "Kind", "Plan", "RaceRound", "TokenLogprob"]


class Arm:
    """Server roles. Plain strings so records stay JSON-friendly."""

    TREATMENT = "treatment"
    CONTROL = "control"
    REFERENCE = "reference"


class Kind:
    """Request kinds within one conversation."""

    TURN1 = "turn1"
    TURN2 = "turn2"  # re-sends turn 1 + the arm's own answer: the cache hit reaches decode-written blocks
    TURN2_FRESH = "turn2-fresh"  # the same prompt with a fresh cache_salt: no reuse possible
    PROBE = "probe"  # shares only turn 1's prompt: the hit ends in the prefill-written region
    PROBE_FRESH = "probe-fresh"
    # Extra resumes (`--resumes`): turn 2 on the answer cut j blocks earlier, and its no-reuse twin.
    RESUME = "resume"

    @staticmethod
    def resume(j: int) -> str:
        return f"{Kind.RESUME}{j}"

    @staticmethod
    def fresh(kind: str) -> str:
        return f"{kind}-fresh"


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()

    @property
    def margin(self) -> float | None:
        """Top-1 minus top-2 logprob at this position; None without two alternatives."""
        if len(self.top) < 2:
            return None
        return self.top[0][1] - self.top[1][1]

    def gap(self, other: TokenLogprob) -> float:
        """Largest |Δ logprob| over the tokens both positions list (chosen and top-k alike): two distributions
        over the next token, compared where both give a figure."""
        mine, theirs = {self.token: self.logprob, **dict(self.top)}, {other.token: other.logprob, **dict(other.top)}
        return max((abs(mine[t] - theirs[t]) for t in mine.keys() & theirs.keys()), default=0.0)


@dataclass(frozen=True)
class Plan:
    """One seeded conversation as the workload planned it."""

    index: int
    turn1_messages: tuple[Mapping[str, str], ...]
    question: str
    answer: str  # the needle the question asks for
    probe_messages: tuple[Mapping[str, str], ...]
    turn1_prompt_tokens: int
    turn1_max_tokens: int


@dataclass(frozen=True)
class RaceRound:
    """One round of the cold-race probe as it was sent."""

    index: int
    blocks: float
    prompt_tokens: int
    racers: int
    followups: int


@dataclass(frozen=True)
class Exchange:
    """One request and what came back. `error` is set instead of raising when the request failed."""

    conversation: int
    arm: str
    kind: str
    case_id: str
    text: str = ""
    tokens: tuple[TokenLogprob, ...] = ()
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    elapsed_s: float = 0.0
    error: str | None = None
    request: Mapping[str, Any] = field(default_factory=dict)
    response: Mapping[str, Any] | None = None
    status_code: int | None = None
    started_s: float | None = None  # seconds from the run's start to the request's, for the report's timeline

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {
            "conversation": self.conversation,
            "arm": self.arm,
            "kind": self.kind,
            "case_id": self.case_id,
            "ok": self.ok,
            "error": self.error,
            "status_code": self.status_code,
            "elapsed_s": round(self.elapsed_s, 4),
            "started_s": None if self.started_s is None else round(self.started_s, 4),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "text": self.text,
            "request": dict(self.request),
            "response": self.response,
        }


@dataclass(frozen=True)
class History:
    block_size: int
    plans: tuple[Plan, ...]
    exchanges: tuple[Exchange, ...]
    deltas: Mapping[str, MetricsDelta] = field(default_factory=dict)  # arm -> settled /metrics delta
    races: tuple[RaceRound, ...] = ()  # cold-race rounds, when that probe ran
    step_budget: int | None = None  # the treatment's max_num_batched_tokens, when stated
    race_window: MetricsDelta | None = None  # the treatment's counters over the cold race alone
    treatment_info: ServerInfo | None = None  # its vLLM release and cache settings, for the trigger's hint
    # Conversations the reference alone ran, beyond the treatment's: a larger yardstick (see RunConfig).
    yardstick: tuple[Plan, ...] = ()
    # What a probe without fields of its own recorded (probe name -> its JSON data, probes/<name>.json).
    extras: Mapping[str, Any] = field(default_factory=dict)

    def plans_of(self, arm: str) -> tuple[Plan, ...]:
        """The conversations `arm` ran: the reference runs the yardstick's extra ones too."""
        return self.plans + self.yardstick if arm == Arm.REFERENCE else self.plans

    def get(self, conversation: int, arm: str, kind: str) -> Exchange | None:
        return self._index.get((conversation, arm, kind))

    def of(self, arm: str, kind: str) -> Iterator[Exchange]:
        return (e for e in self.exchanges if e.arm == arm and e.kind == kind)

    def arms(self) -> set[str]:
        return {e.arm for e in self.exchanges}

    def failed(self) -> Sequence[Exchange]:
        return [e for e in self.exchanges if not e.ok]

    def plan(self, conversation: int) -> Plan | None:
        return next((p for p in (*self.plans, *self.yardstick) if p.index == conversation), None)

    @property
    def _index(self) -> dict[tuple[int, str, str], Exchange]:
        cached: dict[tuple[int, str, str], Exchange] | None = self.__dict__.get("_index_cache")
        if cached is None:
            cached = {(e.conversation, e.arm, e.kind): e for e in self.exchanges}
            object.__setattr__(self, "_index_cache", cached)
        return cached
