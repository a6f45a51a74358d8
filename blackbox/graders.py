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
- race-divergence (the cold-race probe, in `race`): follow-ups resumed from race-written blocks against cold
  racers.

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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from blackbox import errors, metrics, race, stats
from blackbox.compare import deviation
from blackbox.config import GRADERS, Grading
from blackbox.evidence import POWER, Sample, judge_samples
from blackbox.gates import in_decode_region, in_prefill_region, reaches_decode_region
from blackbox.history import Arm, History, Kind, Plan
from blackbox.verdict import Finding, Status

__all__ = [
    "EXACTNESS",
    "GRADER_COVERS_TRIGGER",
    "LOGPROB",
    "Grades",
    "compared_positions",
    "exactness",
    "grade",
    "logprob",
    "recall",
    "samples",
]

Region = Callable[[Plan, int], bool]  # (plan, cached tokens) -> the hit ends in the region


def samples(
    history: History,
    arm: str,
    pairs: Sequence[tuple[str, str]],
    region: Region,
    hard_margin: float,
    tokens: int | None = None,
) -> list[Sample]:
    """Hits of `arm` (request kinds `pairs`: hit, no-reuse twin) whose cached length lies in `region`, each
    against its twin over the first `tokens` answer positions (None: all). Answers without logprobs are left
    out: two empty lists compare equal vacuously (a gate reports them)."""
    out = []
    for plan in history.plans_of(arm):
        for hit, fresh in pairs:
            a, b = history.get(plan.index, arm, hit), history.get(plan.index, arm, fresh)
            if a is None or b is None or not (a.ok and b.ok and a.tokens and b.tokens):
                continue
            if region(plan, a.cached_tokens or 0):
                mine, theirs = a.tokens[:tokens], b.tokens[:tokens]
                out.append(Sample(plan.index, hit, deviation(mine, theirs, hard_margin), mine != theirs))
    return out


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


@dataclass(frozen=True)
class _Comparison:
    check: str
    region: str  # what the hits are, for messages
    pairs: tuple[tuple[str, str], ...]  # (hit, no-reuse twin) request kinds
    where: Region


_BOTH = ((Kind.PROBE, Kind.PROBE_FRESH), (Kind.TURN2, Kind.TURN2_FRESH))
# A turn-2 hit that stops inside the prompt (a missing decode checkpoint) is a prefill-region hit like the probe.
EXACTNESS = _Comparison("exactness", "prefill-region", _BOTH, in_prefill_region)
LOGPROB = _Comparison("logprob", "decode-region", _BOTH[1:], in_decode_region)


def exactness(history: History, grading: Grading, alpha: float | None = None) -> Finding:
    return _versus_reference(history, grading, EXACTNESS, grading.alpha if alpha is None else alpha)


def logprob(history: History, grading: Grading, alpha: float | None = None) -> Finding:
    return _versus_reference(history, grading, LOGPROB, grading.alpha if alpha is None else alpha)


def _versus_reference(history: History, grading: Grading, c: _Comparison, alpha: float) -> Finding:
    """Each kind of hit against the reference's hits of the same kind (a stratum): a turn-2 hit that stopped in
    the prompt resumed from a longer prompt than a probe, and a correct engine can deviate there by more. Pooled
    against a reference of probes only (the reference has no missing decode checkpoints) they read as corruption.
    A kind the reference has no hits of is not graded and is named; the graded kinds share alpha (Bonferroni)."""
    if Arm.REFERENCE not in history.arms():
        return _not_used(
            c.check,
            "needs a reference server (the treatment's flags without speculative decoding): without one this run "
            f"cannot measure how far a correct engine's {c.region} hits deviate from recomputation",
        )
    n = compared_positions(history, grading)
    strata = {
        hit: (
            samples(history, Arm.TREATMENT, [(hit, fresh)], c.where, grading.hard_margin, n),
            samples(history, Arm.REFERENCE, [(hit, fresh)], c.where, grading.hard_margin, n),
        )
        for hit, fresh in c.pairs
    }
    graded = [kind for kind, (t, r) in strata.items() if t and r]
    not_graded = {kind: len(t) for kind, (t, r) in strata.items() if t and not r}
    if not graded:
        t_all, r_all = (sum(len(v[i]) for v in strata.values()) for i in (0, 1))
        why = f"no {c.region} hits to compare (treatment {t_all}, reference {r_all})"
        if not_graded:
            why += f"; {_ungraded(not_graded)}"
        return _not_used(c.check, why)
    found = _strata(c, strata, graded, alpha, len(history.plans))
    deciding = next((f for f in found.values() if f.status is Status.FAIL), None) or next(iter(found.values()))
    figures = {**deciding.figures, "compared_positions": n, "not_graded": not_graded}
    if len(found) > 1:
        figures["strata"] = {kind: {"status": f.status.value, **f.figures} for kind, f in found.items()}
        figures["mismatches"] = [m for f in found.values() for m in f.figures.get("mismatches", ())]
    reason = deciding.reason if len(found) == 1 else "; ".join(f"{_NAMES[k]}: {f.reason}" for k, f in found.items())
    if not_graded:
        reason += f" ({_ungraded(not_graded)})"
    # Strata that could not reach significance at their share and were dropped for the others' sake.
    dropped = {kind: [len(s) for s in strata[kind]] for kind in graded if kind not in found}
    if dropped:
        figures["too_few_to_fail"] = dropped
        reason += "".join(
            f" (not graded: {t} {_NAMES[kind]} hits against {r} could not reach significance)"
            for kind, (t, r) in dropped.items()
        )
    return replace(deciding, reason=reason, figures=figures)


def _strata(
    c: _Comparison, strata: dict[str, tuple[list[Sample], list[Sample]]], graded: list[str], alpha: float, runs: int
) -> dict[str, Finding]:
    """Each graded stratum at its share; one that cannot reach significance at it drops out and the rest are run
    again at the larger share (as `grade` does over graders). The last stratum left is kept either way."""
    while True:
        found = {kind: _judge(c, kind, *strata[kind], alpha / len(graded), runs) for kind in graded}
        usable = [k for k, f in found.items() if f.status in (Status.PASS, Status.FAIL)]
        if len(graded) == 1 or usable == graded:
            return found
        graded = usable or graded[:1]


def _judge(c: _Comparison, kind: str, t: list[Sample], r: list[Sample], alpha: float, runs: int) -> Finding:
    worst = sorted(t, key=lambda s: -s.deviation)[:5]
    what = f"treatment {c.region} hits" if len(c.pairs) == 1 else f"treatment {c.region} {_NAMES[kind]} hits"
    return judge_samples(
        c.check,
        t,
        r,
        alpha=alpha,
        what=what,
        against="the reference's",
        runs=runs,
        hint=f"replay conversations {[s.unit for s in worst]} (the largest deviations) from the run folder's replay/",
    )


_NAMES = {Kind.PROBE: "probe", Kind.TURN2: "turn-2"}


def _ungraded(counts: dict[str, int]) -> str:
    kinds = ", ".join(f"{n} {_NAMES[kind]}" for kind, n in counts.items())
    return f"not graded: {kinds} hits of the treatment, which the reference has none of to compare with"


def _with_positions(n: int, finding: Finding) -> Finding:
    return replace(finding, figures={**finding.figures, "compared_positions": n})


def _recalled(text: str, answer: str) -> bool:
    return answer in " ".join(text.lower().split())


def recall(history: History, grading: Grading, alpha: float | None = None) -> Finding:
    alpha = grading.alpha if alpha is None else alpha
    rows = []  # (conversation, hit right, no-reuse right, control right)
    for plan in history.plans:
        hit, fresh = (
            history.get(plan.index, Arm.TREATMENT, Kind.TURN2),
            history.get(plan.index, Arm.TREATMENT, Kind.TURN2_FRESH),
        )
        # Single-endpoint mode: the treatment's own no-reuse answer is the only baseline.
        control = history.get(plan.index, Arm.CONTROL, Kind.TURN2) or fresh
        if hit is None or fresh is None or control is None or not (hit.ok and fresh.ok and control.ok):
            continue
        if reaches_decode_region(history, plan.index, Arm.TREATMENT):
            answers = (hit.text, fresh.text, control.text)
            rows.append((plan.index, *(_recalled(a, plan.answer) for a in answers)))
    if not rows:
        return _not_used("recall", "no conversation has a decode-region hit with its no-reuse and control answers")
    control_recall = sum(r[3] for r in rows) / len(rows)
    # A flip counts only where the two baselines agree: corruption is hit vs no-reuse on the same server, so a
    # treatment that is simply a weaker model than the control shows as disagreeing baselines, not as flips.
    right = [r for r in rows if r[2] and r[3]]
    forward = [r[0] for r in right if not r[1]]
    reverse = [r[0] for r in rows if r[1] and not r[2] and not r[3]]
    test = stats.sign_test(len(forward), len(reverse))
    critical = stats.sign_critical(len(right), alpha)
    q = stats.detectable_fraction(len(right), critical, POWER)
    figures = {
        "n": len(rows),
        "baselines_right": len(right),
        "control_recall": control_recall,
        "no_reuse_recall": sum(r[2] for r in rows) / len(rows),
        "treatment_recall": sum(r[1] for r in rows) / len(rows),
        "forward_flips": forward,
        "reverse_flips": reverse,
        "p_value": test.p_value,
        "alpha": alpha,
        "detectable_fraction": q,
        "detection_power": POWER,
    }
    if control_recall < grading.min_control_recall:
        return Finding.from_error(
            "recall",
            errors.ControlQualityFailure(
                f"the control recalls {control_recall:.0%} of needles (< {grading.min_control_recall:.0%}): the model "
                "cannot do the task, so recall says nothing about the cache",
                hint="use a model that can recall, or add --reference for the logprob grader",
            ),
            **figures,
        )
    if critical is None:
        return Finding.from_error(
            "recall",
            errors.InsufficientPower(
                f"{len(right)} decode-region hits whose baselines recalled cannot reach p < {alpha:.3g} even if every "
                "one flipped",
                hint=f"run more conversations (at least {math.floor(math.log2(1 / alpha)) + 1} recalled hits)",
            ),
            **figures,
        )
    if test.p_value < alpha:
        return Finding.from_error(
            "recall",
            errors.CorruptionDetected(
                f"the cache-hit answer lost the needle in {len(forward)} of {len(right)} conversations where the "
                f"no-reuse and control answers had it ({len(reverse)} reverse flips), p = {test.p_value:.3g} < "
                f"{alpha:.3g}",
                hint=f"replay the forward flips: conversations {forward}",
            ),
            **figures,
        )
    return Finding.passed(
        "recall",
        f"{len(forward)} forward / {len(reverse)} reverse flips over {len(rows)} decode-region hits, p = "
        f"{test.p_value:.3g}; lost recall in >= {q:.0%} of hits would have been detected with probability {POWER}",
        **figures,
    )


def _not_used(check: str, why: str, error: type[errors.Inconclusive] = errors.NoEvidence) -> Finding:
    return Finding.from_error(check, error(why))


GraderFunction = Callable[[History, Grading, float], Finding]

GRADER_FUNCTIONS: dict[str, GraderFunction] = {"exactness": exactness, "recall": recall, "logprob": logprob}
# Whether a grader judges the hits the trigger gate proved (blocks written during speculative decode, or by a
# fragmented race): a PASS needs at least one of these.
GRADER_COVERS_TRIGGER = {"exactness": False, "recall": True, "logprob": True, "race-divergence": True}


def _race(history: History, grading: Grading, alpha: float) -> Finding:
    n = compared_positions(history, grading)
    return _with_positions(n, race.race_divergence(history, history.races, alpha, grading.hard_margin, n))


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
    functions: dict[str, GraderFunction] = {}
    if "multiturn" in probes:
        functions |= {name: GRADER_FUNCTIONS[name] for name in (grading.graders or GRADERS)}
    if "cold-race" in probes:
        functions["race-divergence"] = _race
    named = set(grading.graders) | ({"race-divergence"} if "cold-race" in probes else set())
    latest = {name: _call(name, fn, history, grading, grading.alpha) for name, fn in functions.items()}
    usable = [name for name, f in latest.items() if _usable(f)]
    while usable:
        share = grading.alpha / len(usable)
        latest |= {name: _call(name, functions[name], history, grading, share) for name in usable}
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


def _call(name: str, fn: GraderFunction, history: History, grading: Grading, alpha: float) -> Finding:
    try:
        finding = fn(history, grading, alpha)
    except Exception as exc:  # a grader's own bug is UNKNOWN, never PASS
        finding = Finding(name, Status.UNKNOWN, f"grader crashed: {type(exc).__name__}: {exc}", {}, "GraderCrashed")
    return replace(finding, stage="grader", covers_trigger=GRADER_COVERS_TRIGGER.get(name, False))
