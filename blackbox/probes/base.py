"""What a probe is: a generator of seeded requests plus the checker of what came back (a Jepsen workload).

A probe declares four things, and the engine, the CLI, the pytest plugin and `blackbox grade` know it only
through them:

- its plans: what it sends, seeded (a module-level function of the probe, called by its driver);
- `drive`: send the plans to the servers in a `DriveContext`, record every exchange, return a `Driven`;
- `gates`: the trigger proof, findings that show the run reached the state the probe exists for (a failed one
  makes the run UNKNOWN, so no grader is believed);
- `graders`: what judges its hits, each a `Grader` (name, function, whether it judges the state the trigger
  proved). One alpha is split over the graders of every probe that ran (`blackbox.graders.grade`).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from blackbox import errors, metrics
from blackbox.client import Endpoint
from blackbox.config import Grading, RunConfig
from blackbox.geometry import Geometry
from blackbox.history import Arm, Exchange, History, Plan, RaceRound
from blackbox.metrics import MetricsDelta, MetricsSnapshot
from blackbox.store import RunStore
from blackbox.verdict import Finding

__all__ = [
    "DEFAULT_COMPARED",
    "DriveContext",
    "Driven",
    "Grader",
    "GraderFunction",
    "Probe",
    "Progress",
    "Record",
    "compared_positions",
    "not_used",
    "settle",
    "with_positions",
]

Progress = Callable[[int, int, str], None]
Record = Callable[[Exchange], Exchange]  # stores an exchange as it completes, returns what graders keep
GraderFunction = Callable[[History, Grading, float], Finding]


@dataclass(frozen=True)
class DriveContext:
    """What a driver may use: the settings, the servers by role, the discovered geometry, the run's cache_salt,
    the recorder every exchange goes through, the progress line and the run folder."""

    config: RunConfig
    endpoints: Mapping[str, Endpoint]
    geometry: Geometry
    salt: str
    record: Record
    progress: Progress
    store: RunStore
    # A run with --detect drives the multiturn probe a round at a time: treatment conversations [start, stop)
    # and the reference's extras that go with them. None: the whole fixed-length run.
    units: tuple[int, int] | None = None

    @property
    def treatment(self) -> Endpoint:
        return self.endpoints[Arm.TREATMENT]


@dataclass(frozen=True)
class Driven:
    """What a driver sent and saw, merged by the engine into the run's `History`. `data` is for a probe whose
    records have no field of their own there: the engine stores it as probes/<name>.json and `History.extras`
    gives it back, from a live run and from a stored one alike."""

    exchanges: tuple[Exchange, ...] = ()
    plans: tuple[Plan, ...] = ()
    yardstick: tuple[Plan, ...] = ()
    races: tuple[RaceRound, ...] = ()
    race_window: MetricsDelta | None = None
    data: Mapping[str, Any] | None = field(default=None)


@dataclass(frozen=True)
class Grader:
    name: str
    judge: GraderFunction
    covers_trigger: bool  # judges the hits the trigger gate proved: a PASS needs at least one such grader


class Probe(ABC):
    """One probe. Subclasses set `name` (its --probe value) and `about` (one line for --help)."""

    name: ClassVar[str]
    about: ClassVar[str]
    # Why `--probe all` leaves this probe out (it needs servers launched for it), or None: `all` runs it.
    launched_for: ClassVar[str | None] = None

    @abstractmethod
    async def drive(self, ctx: DriveContext) -> Driven:
        """Send this probe's seeded requests; every exchange through `ctx.record`."""

    @abstractmethod
    def gates(self, history: History, grading: Grading) -> list[Finding]:
        """The trigger proof, from the history alone."""

    @abstractmethod
    def graders(self, grading: Grading) -> list[Grader]:
        """The graders to run (in auto mode, those whose evidence turns out too thin are left out)."""

    def required(self, grading: Grading) -> frozenset[str]:
        """Graders reported even without evidence or power (named with --grader, or the probe's only one), so the
        verdict stays UNKNOWN rather than passing on the others."""
        return frozenset()


# vLLM (AsyncLLM.output_handler, 0.26-0.32) records a step's counters right after it hands the step's outputs to
# their requests, with no await in between, so a counter trails the response that carries its step by no more than
# the scrape itself; two unchanged scrapes 0.1 s apart see it settled. (0.5 s apart cost a run 1 s of idle servers
# per settle for nothing: bench/results/overhead.md.) Traffic from others keeps it polling, up to `limit_s`.
SETTLE_POLL_S = 0.1
SETTLE_STABLE = 2


async def settle(endpoint: Endpoint, limit_s: float) -> MetricsSnapshot:
    """Poll until the counters we read stop moving: SETTLE_STABLE scrapes in a row unchanged, or `limit_s`."""
    keys = (metrics.CACHE_HITS, metrics.CACHE_QUERIES, metrics.DRAFTS, metrics.ACCEPTED)
    deadline = time.monotonic() + limit_s
    last = await endpoint.metrics()
    stable = 0
    while time.monotonic() < deadline and stable < SETTLE_STABLE:
        await asyncio.sleep(SETTLE_POLL_S)
        current = await endpoint.metrics()
        same = all(current.value(k) == last.value(k) for k in keys)
        stable = stable + 1 if same else 0
        last = current
    return last


# Without speculative-decoding counters: the first token and one verification step of 2 speculative tokens.
DEFAULT_COMPARED = 4


def compared_positions(history: History, grading: Grading) -> int:
    """Answer positions to compare: as asked (--compare-tokens), else the first token (the prefill that resumes
    from the hit) and the first verification step, 1 + k tokens for the treatment's k speculative tokens per
    draft (drafted tokens / drafts on its /metrics over the run)."""
    if grading.compare_tokens is not None:
        return grading.compare_tokens
    delta = history.deltas.get(Arm.TREATMENT)
    drafts = delta.value(metrics.DRAFTS) if delta else None
    drafted = delta.value(metrics.DRAFT_TOKENS) if delta else None
    if not drafts or drafted is None or drafted < drafts:
        return DEFAULT_COMPARED
    return 2 + round(drafted / drafts)


def with_positions(n: int, finding: Finding) -> Finding:
    return replace(finding, figures={**finding.figures, "compared_positions": n})


def not_used(check: str, why: str, error: type[errors.Inconclusive] = errors.NoEvidence) -> Finding:
    return Finding.from_error(check, error(why))
