"""Graders: is the treatment's output worse than what a correct engine gives for the same input?

- exactness: where a correct engine is bit-exact (a hit that ends in the prefill-written region), the cache-hit
  answer must equal the same server's no-reuse answer (fresh cache_salt) token for token, logprob for logprob.
- recall: needle recall of the treatment against the control on identical turn-2 prompts; exact sign test of
  forward flips (control right, treatment wrong) against reverse flips.
- logprob: hits that reach decode-written blocks legitimately deviate from recomputation, so the treatment's
  deviation (hit vs no-reuse) is judged against the same deviation on a reference server that resumes the same
  way with speculative decoding off: on the largest pre-divergence deviation, a rank test (shift) and an exact
  exceedance test (a subset beyond every reference value: a fault that fires in some conversations), and Fisher on
  confident token flips, alpha/3 each.

A grader without evidence returns a `NoEvidence` (or `ControlQualityFailure`) finding; `grade` leaves those out
in auto mode and says so, but keeps them when the grader was asked for by name.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from blackbox import errors, race, stats
from blackbox.config import GRADERS, Grading
from blackbox.gates import decode_region_hits
from blackbox.history import Arm, Exchange, History, Kind, TokenLogprob
from blackbox.verdict import Finding, Status

__all__ = ["Divergence", "deviations", "divergence", "exactness", "grade", "logprob", "recall"]


@dataclass(frozen=True)
class Divergence:
    position: int  # first position whose chosen token differs; -1 when none does
    margin: float | None  # the no-reuse arm's top-1 margin there


def divergence(hit: Sequence[TokenLogprob], fresh: Sequence[TokenLogprob]) -> Divergence:
    for i, (a, b) in enumerate(zip(hit, fresh, strict=False)):
        if a.token != b.token:
            return Divergence(i, b.margin)
    return Divergence(-1, None)


def deviations(hit: Sequence[TokenLogprob], fresh: Sequence[TokenLogprob]) -> tuple[float, float] | None:
    """(first-token deviation, largest deviation before the first divergence) of a hit against recomputation.

    The first-token deviation is the largest |Δ logprob| over the top-k tokens both arms list at position 0: on a
    correct engine it is small (median ~0.06 on the tiny CPU model, ~3e-4 measured elsewhere). The second is the
    larger of it and every |Δ chosen logprob| up to the first differing token: a wrong state often shows a few
    tokens in rather than at once.
    """
    if not hit or not fresh:
        return None
    first = hit[0].gap(fresh[0])
    end = divergence(hit, fresh).position
    upto = len(hit) if end < 0 else end
    before = (abs(a.logprob - b.logprob) for a, b in zip(hit[:upto], fresh[:upto], strict=False))
    return first, max([first, *before])


def _not_used(check: str, why: str, error: type[errors.Inconclusive] = errors.NoEvidence) -> Finding:
    return Finding.from_error(check, error(why))


def _pairs(history: History, arm: str, hit: str, fresh: str) -> list[tuple[int, Exchange, Exchange]]:
    out = []
    for plan in history.plans:
        a, b = history.get(plan.index, arm, hit), history.get(plan.index, arm, fresh)
        if a is not None and b is not None and a.ok and b.ok:
            out.append((plan.index, a, b))
    return out


def exactness(history: History, grading: Grading) -> Finding:
    checked: list[int] = []
    mismatches: list[dict[str, object]] = []
    for hit_kind, fresh_kind in ((Kind.PROBE, Kind.PROBE_FRESH), (Kind.TURN2, Kind.TURN2_FRESH)):
        for conv, hit, fresh in _pairs(history, Arm.TREATMENT, hit_kind, fresh_kind):
            plan = history.plan(conv)
            cached = hit.cached_tokens or 0
            if plan is None or not 0 < cached <= plan.turn1_prompt_tokens or not hit.tokens or not fresh.tokens:
                continue  # only prefill-region hits carry the promise; without logprobs equality is vacuous
            checked.append(conv)
            diff = _first_difference(hit.tokens, fresh.tokens)
            if diff is not None:
                mismatches.append({"conversation": conv, "kind": hit_kind, "cached_tokens": cached, **diff})
    figures = {"checked": len(checked), "mismatches": mismatches}
    if not checked:
        return _not_used("exactness", "no cache hit ended in the prefill-written region")
    if mismatches:
        convs = sorted({int(str(m["conversation"])) for m in mismatches})
        return Finding.from_error(
            "exactness",
            errors.CorruptionDetected(
                f"{len(mismatches)} of {len(checked)} prefill-region cache hits differ from recomputation on the same "
                f"server (conversations {convs}); a correct engine is bit-exact here",
                hint="replay the listed conversations with the commands in the run folder's replay/",
            ),
            **figures,
        )
    return Finding.passed("exactness", f"{len(checked)} prefill-region hits identical to recomputation", **figures)


def _first_difference(a: Sequence[TokenLogprob], b: Sequence[TokenLogprob]) -> dict[str, object] | None:
    if len(a) != len(b):
        return {"position": min(len(a), len(b)), "what": f"length {len(a)} vs {len(b)}"}
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:  # token, logprob and top-k alike
            return {"position": i, "what": f"{x.token!r} {x.logprob:.6g} vs {y.token!r} {y.logprob:.6g}"}
    return None


def _recalled(exchange: Exchange | None, answer: str) -> bool:
    return exchange is not None and answer in " ".join(exchange.text.lower().split())


def recall(history: History, grading: Grading) -> Finding:
    convs = decode_region_hits(history, Arm.TREATMENT)
    rows = []
    for conv in convs:
        plan = history.plan(conv)
        t, c = history.get(conv, Arm.TREATMENT, Kind.TURN2), history.get(conv, Arm.CONTROL, Kind.TURN2)
        if plan is not None and c is not None and c.ok:
            rows.append((conv, _recalled(t, plan.answer), _recalled(c, plan.answer)))
    if not rows:
        return _not_used("recall", "no conversation has both a decode-region hit and a control answer")
    forward = [conv for conv, t_ok, c_ok in rows if c_ok and not t_ok]
    reverse = [conv for conv, t_ok, c_ok in rows if t_ok and not c_ok]
    control_recall = sum(c for _, _, c in rows) / len(rows)
    treatment_recall = sum(t for _, t, _ in rows) / len(rows)
    test = stats.sign_test(len(forward), len(reverse))
    k = stats.min_flips_detectable(grading.alpha)
    figures = {
        "n": len(rows),
        "control_recall": control_recall,
        "treatment_recall": treatment_recall,
        "forward_flips": forward,
        "reverse_flips": reverse,
        "p_value": test.p_value,
        "alpha": grading.alpha,
        "min_detectable_drop": k / len(rows),
    }
    if control_recall < grading.min_control_recall:
        return Finding.from_error(
            "recall",
            errors.ControlQualityFailure(
                f"the control recalls {control_recall:.0%} of needles (< {grading.min_control_recall:.0%}): the model "
                "cannot do the task, so recall says nothing about the cache",
                hint="use a model that can recall, or grade with --grader logprob",
            ),
            **figures,
        )
    detect = f"smallest detectable drop {k}/{len(rows)} = {k / len(rows):.0%}"
    if test.p_value < grading.alpha:
        return Finding.from_error(
            "recall",
            errors.CorruptionDetected(
                f"recall {treatment_recall:.0%} vs control {control_recall:.0%}: {len(forward)} forward vs "
                f"{len(reverse)} reverse flips, p = {test.p_value:.3g} < {grading.alpha} ({detect})",
                hint=f"replay the forward flips: conversations {forward}",
            ),
            **figures,
        )
    return Finding.passed(
        "recall",
        f"recall {treatment_recall:.0%} vs control {control_recall:.0%}, "
        f"{len(forward)} forward / {len(reverse)} reverse flips, p = {test.p_value:.3g} ({detect})",
        **figures,
    )


def _arm_deviations(history: History, arm: str, hard_margin: float) -> tuple[list[float], list[float], int, int]:
    qualifying = set(decode_region_hits(history, arm))
    firsts, prefixes, hard = [], [], 0
    for conv, hit, fresh in _pairs(history, arm, Kind.TURN2, Kind.TURN2_FRESH):
        dev = deviations(hit.tokens, fresh.tokens) if conv in qualifying else None
        if dev is None:
            continue
        firsts.append(dev[0])
        prefixes.append(dev[1])
        d = divergence(hit.tokens, fresh.tokens)
        hard += d.margin is not None and d.margin >= hard_margin
    return firsts, prefixes, hard, len(firsts)


def logprob(history: History, grading: Grading) -> Finding:
    if Arm.REFERENCE not in history.arms():
        return _not_used("logprob", "needs a reference server (treatment flags, speculative decoding off)")
    t_first, t_prefix, t_hard, n_t = _arm_deviations(history, Arm.TREATMENT, grading.hard_margin)
    r_first, r_prefix, r_hard, n_r = _arm_deviations(history, Arm.REFERENCE, grading.hard_margin)
    if n_t < 3 or n_r < 3:
        return _not_used("logprob", f"too few decode-region hits to compare (treatment {n_t}, reference {n_r})")
    tests = [
        stats.mann_whitney_greater(t_prefix, r_prefix),
        stats.exceedance(t_prefix, r_prefix),
        stats.fisher_greater(t_hard, n_t - t_hard, r_hard, n_r - r_hard),
    ]
    level = grading.alpha / len(tests)
    names = ("deviation shift", "deviations beyond the reference", "hard divergences")
    figures = {
        "n_treatment": n_t,
        "n_reference": n_r,
        "alpha_per_test": level,
        "treatment_first_token": _summary(t_first),
        "reference_first_token": _summary(r_first),
        "treatment_prefix": _summary(t_prefix),
        "reference_prefix": _summary(r_prefix),
        "treatment_hard_divergences": t_hard,
        "reference_hard_divergences": r_hard,
        "p_values": {name: t.p_value for name, t in zip(names, tests, strict=True)},
    }
    failed = [f"{name} p = {t.p_value:.3g}" for name, t in zip(names, tests, strict=True) if t.p_value < level]
    floor = f"noise floor (reference first-token p95) {stats.quantile(r_first, 0.95):.3g}"
    if failed:
        return Finding.from_error(
            "logprob",
            errors.CorruptionDetected(
                f"decode-region hits deviate from recomputation more with speculative decoding than without: "
                f"{'; '.join(failed)} (< {level:.3g}); treatment first-token median {statistics.median(t_first):.3g} "
                f"vs reference {statistics.median(r_first):.3g}; {floor}",
                hint="replay the conversations with the largest first-token deviation (figures in verdict.json)",
            ),
            **figures,
        )
    worst = min(t.p_value for t in tests)
    return Finding.passed(
        "logprob",
        f"treatment deviations within the reference's ({floor}; smallest p = "
        f"{worst:.3g} >= {level:.3g}; n = {n_t} vs {n_r})",
        **figures,
    )


def _summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"median": statistics.median(values), "p95": stats.quantile(values, 0.95), "max": max(values)}


GRADER_FUNCTIONS: dict[str, Callable[[History, Grading], Finding]] = {
    "exactness": exactness,
    "recall": recall,
    "logprob": logprob,
}


@dataclass(frozen=True)
class Grades:
    findings: tuple[Finding, ...]
    used: tuple[str, ...]
    not_used: tuple[tuple[str, str], ...]  # (grader, why) in auto mode


def grade(history: History, grading: Grading, probes: Sequence[str] = ("multiturn",)) -> Grades:
    chosen = (grading.graders or GRADERS) if "multiturn" in probes else ()
    auto = not grading.graders
    findings: list[Finding] = []
    used: list[str] = []
    not_used: list[tuple[str, str]] = []
    if "cold-race" in probes:
        findings.append(race.race_divergence(history, history.races, grading.alpha, grading.hard_margin))
        used.append("race-divergence")
    for name in chosen:
        crashed = False
        try:
            finding = GRADER_FUNCTIONS[name](history, grading)
        except Exception as exc:  # a grader's own bug is UNKNOWN, never PASS
            finding = Finding(name, Status.UNKNOWN, f"grader crashed: {type(exc).__name__}: {exc}", {}, "NoEvidence")
            crashed = True
        if auto and finding.status is Status.UNKNOWN and not crashed:  # a crash is not a lack of evidence
            not_used.append((name, finding.reason))
            continue
        findings.append(finding)
        used.append(name)
    if not findings:
        why = "; ".join(f"{n}: {w}" for n, w in not_used)
        findings.append(Finding.from_error("graders", errors.NoEvidence(f"no grader had evidence to judge ({why})")))
    return Grades(tuple(findings), tuple(used), tuple(not_used))
