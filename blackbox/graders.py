"""Graders: is the treatment's output worse than what a correct engine gives for the same input?

Every grader compares like with like and measures its own yardstick inside the run; none assumes bit-exactness.

- exactness: hits that end in the prefill-written region (the probe, and a turn 2 that stopped there), hit vs
  recomputation (a fresh cache_salt) on the treatment, against the same on the reference (same cache flags, no
  speculative decoding), each kind against the reference's hits of that kind (a kind it has none of is not
  graded). Where the reference is bit-exact, a treatment difference is beyond every reference value; where it is
  not (a prefill chunked mid-block, a GPU's reduction order), the treatment must not deviate more than the
  reference does.
- logprob: hits that resume from decode-written blocks (turn 2), the same comparison. A correct engine is not
  exact there, with or without speculative decoding, so only the reference is a fair yardstick.
- recall: needle recall on decode-region hits; a flip is the hit's answer disagreeing with both the treatment's
  own no-reuse answer and the control's when those two agree; exact sign test of forward against reverse flips.
- race-divergence (the cold-race probe, `probes.cold_race`): follow-ups resumed from race-written blocks against
  cold racers.

Each grader belongs to a probe (`blackbox.probes`: exactness, logprob and recall to the multi-turn probe); this
module runs those of the probes a run named.

One alpha for the run is split equally over the graders that are used (Bonferroni: the graders share data, so
their tests are not independent, and Bonferroni holds under any dependence). A grader is used only if its sample
could reach significance at its share (`InsufficientPower` otherwise, with the run length that would do); each
one splits its share again over its own tests. Each PASS states what it could have seen.

The deviation of a hit from its recomputation is the largest |Δ logprob| over every token both sides list (chosen
and top-k) at each position up to and including the first differing token, infinite where the tokens part while
recomputation was sure (its top-1 margin >= `hard_margin`): a wrong state moves runners-up and flips near-ties as
readily as it moves the chosen token. Only the first `compare_tokens` positions count (by default the first token
and the first verification step: 2 + the treatment's speculative tokens per draft, read from its /metrics; 4 if
/metrics does not say): a wrong restored state shows from the first token on, while later positions were verified
in draft splits that differ between a hit and its twin, and on a GPU they drift apart further under speculative
decoding than without it (measured on the H200: a clean treatment's deviations over whole answers reached 3 nat
where its reference's stayed under 0.4, and read FAIL; over 4 positions the two matched, and both faults still
gave p < 1e-7; bench/results/gpu.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from blackbox import errors
from blackbox.config import Grading
from blackbox.history import History
from blackbox.probes import selected
from blackbox.probes.base import DEFAULT_COMPARED, Grader, compared_positions
from blackbox.probes.multiturn import (
    EXACTNESS,
    GRADER_FUNCTIONS,
    LOGPROB,
    exactness,
    logprob,
    recall,
    samples,
)
from blackbox.verdict import Finding, Status

__all__ = [
    "DEFAULT_COMPARED",
    "EXACTNESS",
    "GRADER_FUNCTIONS",
    "LOGPROB",
    "Grades",
    "compared_positions",
    "exactness",
    "grade",
    "logprob",
    "recall",
    "samples",
]


@dataclass(frozen=True)
class Grades:
    findings: tuple[Finding, ...]
    used: tuple[str, ...]
    not_used: tuple[tuple[str, str], ...]  # (grader, why)
    alpha_per_grader: float | None = None


_NOT_USABLE = {e.__name__ for e in (errors.NoEvidence, errors.InsufficientPower, errors.ControlQualityFailure)}


def grade(history: History, grading: Grading, probes: Sequence[str] = ("multiturn",)) -> Grades:
    """Run the graders the probes allow, at one alpha split over those that are used.

    A grader with no evidence even at the whole alpha takes no share. The others are run at alpha / (how many
    remain); any that cannot reach significance at that share drops out and the rest are run again at the larger
    share, until every grader left is usable at its share (the set only shrinks, so this ends). In auto mode an
    unusable grader is left out and said why; a grader named with --grader stays in, so the verdict is UNKNOWN
    without its evidence."""
    chosen = selected(probes)
    functions: dict[str, Grader] = {g.name: g for p in chosen for g in p.graders(grading)}
    named = {name for p in chosen for name in p.required(grading)}
    latest = {name: _call(g, history, grading, grading.alpha) for name, g in functions.items()}
    usable = [name for name, f in latest.items() if _usable(f)]
    while usable:
        share = grading.alpha / len(usable)
        latest |= {name: _call(functions[name], history, grading, share) for name in usable}
        still = [name for name in usable if _usable(latest[name])]
        if still == usable:
            break
        usable = still
    findings: list[Finding] = []
    not_used: list[tuple[str, str]] = []
    for name, finding in latest.items():
        if name in usable or name in named or finding.error_class not in _NOT_USABLE:
            findings.append(finding)  # used, asked for by name, or a grader's crash: never left out quietly
        else:
            not_used.append((name, finding.reason))
    return Grades(tuple(findings), tuple(usable), tuple(not_used), grading.alpha / len(usable) if usable else None)


def _usable(finding: Finding) -> bool:
    return finding.status in (Status.PASS, Status.FAIL)


def _call(grader: Grader, history: History, grading: Grading, alpha: float) -> Finding:
    try:
        finding = grader.judge(history, grading, alpha)
    except Exception as exc:  # a grader's own bug is UNKNOWN, never PASS
        reason = f"grader crashed: {type(exc).__name__}: {exc}"
        finding = Finding(grader.name, Status.UNKNOWN, reason, {}, "GraderCrashed")
    return replace(finding, stage="grader", covers_trigger=grader.covers_trigger)
