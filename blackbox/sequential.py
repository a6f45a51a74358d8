"""A run that stops when the answer is known (`--detect Q`): multiturn conversations in rounds, a look after each.

The design is fixed before the first request: rounds of R conversations, at most M, so looks at n_k = k*R
(k = 1..K, K = ceil(M / R), the last one at M), and a planned look j: the first at which a correct engine's run
is expected to PASS covering Q (`planned_look`, from Q, `--resumes` and the graders' count, one decode-region
unit a conversation). Look k judges everything sent so far with the run's whole verdict rule (gates, then every
grader) at alpha_k, a share of alpha fixed by an alpha-spending function of the conversations sent (Lan & DeMets
1983): `PLAN_SHARE` of alpha spent linearly over looks 1..j, the rest linearly over the looks after j (no plan:
linear over all K, the Pocock-type boundary). Most runs stop at or before j (a PASS there, or a FAIL on a dense
fault earlier), so that is where the level is spent. The run stops at the first look whose verdict is

- FAIL: corruption, established at that look's level;
- PASS with coverage: every gate passed and a grader judging the trigger's hits could have seen corruption in at
  most Q of them (its `detectable_fraction`, at alpha_k, probability 0.95);
- ERROR, or a failed gate: the premise is broken and more conversations will not mend it.

Anything else (a PASS that cannot yet promise Q, a grader still short of power) sends the next round. The budget
(M, or `--deadline`) ends the run UNKNOWN `InsufficientPower`, saying what a longer run would need.

Why this is valid whatever made the run stop: a correct engine reads FAIL at look k with probability at most
alpha_k (each look's rule is the fixed-length rule at that level), so at any look at most sum alpha_k = alpha
(the union bound, Bonferroni over planned looks). The plan is a function of the configuration alone, so it is
fixed before any data: a wrong plan costs power (a run that misses look j tests at the smaller shares after it),
never level. The bound needs nothing about how the looks depend on each
other, which matters here: the graders' tests are exact rank, hypergeometric and binomial tests whose statistics
over successive looks have no normal joint law to compute a tighter boundary from (Jennison & Turnbull, ch. 7, do
that for normal statistics). It is conservative, and the price is the per-look level (alpha/K when linear,
PLAN_SHARE * alpha / j up to a plan) rather than alpha;
tests/test_sequential.py measures both the size under the null with this stopping rule (20 000 simulated runs) and
the inflation of looking at the full alpha each time. A PASS or FAIL from here states the look, the conversations
it took and the level it was judged at. Stopping for a PASS spends no alpha: only FAIL is an error under the
null.

A stored run is judged again look by look from its history (`judge`), so `blackbox grade` reproduces where it
stopped; each look sees the plans and exchanges of its conversations and the run's whole counters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from blackbox import errors, evidence, stats
from blackbox.history import History, Kind
from blackbox.verdict import Finding, Status, Verdict, merge

__all__ = ["Look", "Schedule", "coverage", "expected_pass_look", "judge", "look", "planned_look", "stops", "subset"]

# What one judgement of a history at a level returns: its verdict, and the grades that go with it.
Judge = Callable[[History, float], tuple[Verdict, Any]]

# The share of alpha spent by the planned look. A run that goes past it (a yield below one unit a conversation, or
# a fault that shows but not yet enough) is judged at the rest, spread over up to M.
PLAN_SHARE = 0.8
# Graders a run judges with when none is named (exactness and logprob), each with three tests: the plan's split.
_AUTO_GRADERS, _TESTS_PER_GRADER = 2, 3

_MENDED_BY_MORE = frozenset({"InsufficientPower", "NoEvidence"})
# Requests of the multiturn probe, which alone is driven in rounds; other probes' records stay in every look.
_ROUNDED_KINDS = frozenset({Kind.TURN1, Kind.TURN2, Kind.TURN2_FRESH, Kind.PROBE, Kind.PROBE_FRESH})


def _rounded(kind: str) -> bool:
    return kind in _ROUNDED_KINDS or kind.startswith(Kind.RESUME)


@dataclass(frozen=True)
class Schedule:
    """The planned looks: rounds of `round` conversations, at most `maximum`; `share` of alpha spent linearly up to
    look `planned` (1-based; 0: no plan, alpha spent linearly over all looks), the rest linearly after it."""

    round: int
    maximum: int
    alpha: float
    ratio: int = 1  # the reference's conversations per treatment conversation
    planned: int = 0
    share: float = PLAN_SHARE

    @property
    def looks(self) -> tuple[int, ...]:
        """Treatment conversations at each look."""
        return tuple(min(self.maximum, k * self.round) for k in range(1, math.ceil(self.maximum / self.round) + 1))

    def level(self, k: int) -> float:
        """alpha_k of look k (1-based): the share of alpha its round's conversations add."""
        looks = (0, *self.looks)
        added = looks[k] - looks[k - 1]
        j = self.planned
        if not 0 < j < len(self.looks):
            return self.alpha * added / self.maximum
        if k <= j:
            return self.share * self.alpha * added / looks[j]
        return (1 - self.share) * self.alpha * added / (self.maximum - looks[j])

    def describe(self) -> str:
        if not 0 < self.planned < len(self.looks):
            return f"alpha {self.alpha:g} spent linearly over the looks"
        return (
            f"alpha {self.alpha:g}: {self.share:.0%} spent by look {self.planned}, where a PASS was planned, "
            "the rest over the looks after it"
        )

    def yardstick_range(self, start: int, stop: int) -> range:
        """Indices of the reference's extra conversations that go with treatment conversations [start, stop):
        they are numbered from `maximum` on, so every look's yardstick is the same draws whatever the run's
        length."""
        extra = self.ratio - 1
        return range(self.maximum + extra * start, self.maximum + extra * stop)


def _promises(n: int, level: float, schedule: Schedule, detect: float, resumes: int, graders: int) -> bool:
    """Whether a look of n conversations at `level`, one unit a conversation (a conversation's largest deviation
    over its `resumes`, which must cover the conversation fraction `either_fraction(detect, resumes)`), a yardstick
    `ratio` times as large and the level split over `graders` of three tests as `evidence` splits it, could PASS
    covering `detect` (power `evidence.POWER`)."""
    per_test = level / (graders * _TESTS_PER_GRADER)
    critical = stats.exceedance_critical(n, schedule.ratio * n, per_test, ranks=evidence.RANKS)
    q = stats.detectable_fraction(n, critical, evidence.POWER)
    return q is not None and q <= stats.either_fraction(detect, resumes)


def planned_look(
    detect: float,
    resumes: int,
    schedule: Schedule,
    graders: int | None = None,
    share: float = PLAN_SHARE,
) -> int:
    """The first look (before the last) at which a correct engine's run is expected to PASS covering `detect` of
    decode-region hits, were `share` of alpha spent linearly up to it (`_promises`); 0 where none is (alpha is then
    spent linearly). A planning figure only: it decides how alpha is spread, never a verdict."""
    looks = (0, *schedule.looks)
    for j in range(1, len(looks) - 1):
        level = share * schedule.alpha * (looks[j] - looks[j - 1]) / looks[j]
        if _promises(looks[j], level, schedule, detect, resumes, graders or _AUTO_GRADERS):
            return j
    return 0


def expected_pass_look(detect: float, resumes: int, schedule: Schedule, graders: int = _AUTO_GRADERS) -> int | None:
    """The look at which a correct engine's run of `schedule` is expected to PASS covering `detect` (`_promises`
    at each look's own level); None where the budget ends first. For planning tables (bench/plan.py)."""
    for k, n in enumerate(schedule.looks, 1):
        if _promises(n, schedule.level(k), schedule, detect, resumes, graders):
            return k
    return None


@dataclass(frozen=True)
class Look:
    index: int  # 1-based
    conversations: int
    alpha: float
    status: Status
    error_class: str | None
    coverage: float | None  # the smallest detectable fraction of the PASS, if it is one
    stop: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "look": self.index,
            "conversations": self.conversations,
            "alpha": self.alpha,
            "status": self.status.value,
            "error_class": self.error_class,
            "coverage": self.coverage,
            "stop": self.stop,
        }


def coverage(verdict: Verdict) -> float | None:
    """The smallest fraction of the trigger's hits a PASS could have caught corruption in (with probability
    `evidence.POWER`), over the graders that judged those hits; None where the verdict is no PASS or none says.
    A grader that scored conversations by their largest over several resumes (`--resumes`) states the fraction of
    resumes its conversation fraction covers where boundaries fail independently; that is the one used, and the
    PASS names the assumption."""
    if verdict.status is not Status.PASS:
        return None
    fractions = [
        f.figures.get("detectable_fraction_of_resumes", f.figures.get("detectable_fraction"))
        for f in verdict.findings
        if f.stage == "grader" and f.covers_trigger and f.status is Status.PASS
    ]
    known = [float(q) for q in fractions if q is not None]
    return min(known, default=None)


def stops(verdict: Verdict, detect: float) -> bool:
    """Whether a look's verdict ends the run (module docstring)."""
    if verdict.status is Status.PASS:
        q = coverage(verdict)
        return q is not None and q <= detect
    if verdict.status in (Status.FAIL, Status.ERROR):
        return True
    # UNKNOWN: a grader short of power or evidence is what more conversations mend; a failed gate, a control
    # that cannot do the task or a grader's crash is not.
    return any(
        f.status is not Status.PASS and (f.stage != "grader" or f.error_class not in _MENDED_BY_MORE)
        for f in verdict.findings
    )


def subset(history: History, schedule: Schedule, conversations: int) -> History:
    """The history as it stood at a look of `conversations` treatment conversations."""
    keep = {p.index for p in history.plans if p.index < conversations}
    keep |= {p.index for p in history.yardstick if p.index in schedule.yardstick_range(0, conversations)}
    return replace(
        history,
        plans=tuple(p for p in history.plans if p.index in keep),
        yardstick=tuple(p for p in history.yardstick if p.index in keep),
        exchanges=tuple(e for e in history.exchanges if not _rounded(e.kind) or e.conversation in keep),
    )


def look(verdict: Verdict, k: int, conversations: int, alpha: float, detect: float) -> Look:
    return Look(k, conversations, alpha, verdict.status, verdict.error_class, coverage(verdict), stops(verdict, detect))


def judge(history: History, schedule: Schedule, detect: float, judge_at: Judge) -> tuple[Verdict, Any]:
    """Every look the history reaches, in order, up to the first that stops: the run's verdict and grades."""
    sent = len(history.plans)
    looks: list[Look] = []
    verdict, grades = None, None
    for k, n in enumerate(schedule.looks, 1):
        if n > sent and looks:
            break
        alpha = schedule.level(k)
        verdict, grades = judge_at(subset(history, schedule, n), alpha)
        looks.append(look(verdict, k, min(n, sent), alpha, detect))
        if looks[-1].stop:
            break
    assert verdict is not None
    return _final(verdict, looks, schedule, detect), grades


def _final(verdict: Verdict, looks: Sequence[Look], schedule: Schedule, detect: float) -> Verdict:
    last = looks[-1]
    figures = {
        "detect": detect,
        "round": schedule.round,
        "max_conversations": schedule.maximum,
        "planned_looks": len(schedule.looks),
        "planned_pass_look": schedule.planned or None,
        "plan_share": schedule.share if schedule.planned else None,
        "alpha": schedule.alpha,
        "looks": [x.to_json() for x in looks],
        "stopped_at_look": last.index,
        "conversations": last.conversations,
    }
    where = (
        f"look {last.index} of {len(schedule.looks)} planned, after {last.conversations} conversations, judged at "
        f"alpha {last.alpha:.3g} ({schedule.describe()})"
    )
    if last.stop:
        gate = Finding.passed("sequential", f"stopped at {where}", **figures)
        final = merge([*verdict.findings, gate])
        if final.status in (Status.PASS, Status.FAIL):
            final = replace(final, reason=f"{final.reason} [sequential: stopped at {where}]")
        return final
    q = "no PASS" if last.coverage is None else f"a PASS covering {last.coverage:.0%} of hits"
    more = _more(verdict, detect, last)
    error = errors.InsufficientPower(
        f"the budget ended the run at {where} with {q}, short of --detect {detect:g}"
        + (f"; about {more} conversations at this run's yield would reach it" if more else ""),
        hint=f"raise --max-conversations (to about {more})" if more else "raise --max-conversations or --deadline",
    )
    return merge([*verdict.findings, Finding.from_error("sequential", error, **figures, more_needed=more)])


def _more(verdict: Verdict, detect: float, last: Look) -> int | None:
    """Conversations that would promise `detect` at the last look's yield (hits per conversation), yardstick
    ratio and per-test level: a planning figure for --max-conversations (a longer schedule spends alpha over more
    looks, so it is a lower bound)."""
    for f in verdict.findings:
        fig = f.figures
        if not (f.stage == "grader" and f.covers_trigger and fig.get("n_subject") and fig.get("alpha_per_test")):
            continue
        n_s, n_y = int(fig["n_subject"]), int(fig["n_yardstick"])
        # Over several resumes a conversation the grader's units are conversations (see `coverage`).
        per = int(fig.get("resumes_per_conversation") or 1)
        need = stats.conversations_needed(
            last.conversations,
            n_s,
            float(fig["alpha_per_test"]),
            stats.either_fraction(detect, per),
            0.95,
            ratio=n_y / n_s,
            ranks=int(fig.get("exceedance_ranks", 1)),
        )
        if need:
            return int(need)
    return None
