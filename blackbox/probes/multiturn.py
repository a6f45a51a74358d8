"""The multi-turn probe: blocks written while speculative decoding runs, re-used by the next turn (A2).

Plans (`blackbox.workload.plan_conversation`, seeded by run seed and conversation): turn 1 is a document of facts
whose prompt ends a little below a block boundary, and its answer is forced on for several blocks, so the blocks
past the prompt are written while the drafter speculates. Turn 2 re-sends turn 1 and the arm's own answer and asks
for one needle: its hit reaches the decode-written blocks. Each hit is also sent with a fresh cache_salt
(recomputation), and the probe, sharing only turn 1's document, hits the prefill-written region.

Trigger proof: enough turn-2 hits end past turn 1's prompt (`trigger`), and the drafter proposed and had tokens
accepted (`drafter_live`). Graders: exactness (prefill-region hits), logprob (decode-region hits), both against
the reference's; recall (needle flips against the treatment's no-reuse answer and the control's).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from blackbox import errors, metrics, stats
from blackbox.client import Endpoint, gather_bounded
from blackbox.compare import deviation
from blackbox.config import GRADERS, Grading, RunConfig
from blackbox.evidence import POWER, Sample, judge_samples
from blackbox.geometry import Geometry
from blackbox.history import Arm, Exchange, History, Kind, Plan
from blackbox.probes.base import (
    DriveContext,
    Driven,
    Grader,
    GraderFunction,
    Probe,
    Progress,
    Record,
    compared_positions,
    not_used,
)
from blackbox.server_info import trigger_hint
from blackbox.verdict import Finding, Status
from blackbox.workload import plan_conversation, resume_cut, turn1_body, turn2_body, turn2_messages

__all__ = [
    "EXACTNESS",
    "GRADER_FUNCTIONS",
    "LOGPROB",
    "MULTITURN",
    "Multiturn",
    "decode_region_hits",
    "drafter_live",
    "exactness",
    "in_decode_region",
    "in_prefill_region",
    "logprob",
    "reaches_decode_region",
    "recall",
    "resume_kinds",
    "resume_maxima",
    "samples",
    "trigger",
]

Region = Callable[[Plan, int], bool]  # (plan, cached tokens) -> the hit ends in the region


def in_prefill_region(plan: Plan, cached: int) -> bool:
    """A hit that ends inside turn 1's prompt resumes from a checkpoint written during prefill."""
    return 0 < cached <= plan.turn1_prompt_tokens


def in_decode_region(plan: Plan, cached: int) -> bool:
    """A hit that ends past turn 1's prompt resumes from a checkpoint written while turn 1 was decoding (the block
    the prompt ended in was completed by decode): the blocks speculative decoding wrote."""
    return cached > plan.turn1_prompt_tokens


def reaches_decode_region(history: History, conversation: int, arm: str) -> bool:
    plan = history.plan(conversation)
    turn2 = history.get(conversation, arm, Kind.TURN2)
    if plan is None or turn2 is None or not turn2.ok or turn2.cached_tokens is None:
        return False
    return in_decode_region(plan, turn2.cached_tokens)


def decode_region_hits(history: History, arm: str) -> list[int]:
    return [p.index for p in history.plans if reaches_decode_region(history, p.index, arm)]


def trigger(history: History, grading: Grading) -> Finding:
    plans = history.plans
    turn2 = [history.get(p.index, Arm.TREATMENT, Kind.TURN2) for p in plans]
    reported = [e for e in turn2 if e is not None and e.ok and e.cached_tokens is not None]
    hits = decode_region_hits(history, Arm.TREATMENT)
    need = max(1, math.ceil(grading.min_trigger_fraction * len(plans)))
    figures = {
        "conversations": len(plans),
        "decode_region_hits": len(hits),
        "needed": need,
        "fraction": len(hits) / len(plans) if plans else 0.0,
        "cached_tokens": [e.cached_tokens if e else None for e in turn2],
        "turn1_prompt_tokens": [p.turn1_prompt_tokens for p in plans],
    }
    if plans and not reported:
        return Finding.from_error(
            "trigger",
            errors.TriggerNotExercised(
                "the treatment reported no usage.prompt_tokens_details.cached_tokens",
                hint="start the treatment with --enable-prompt-tokens-details",
            ),
            **figures,
        )
    if len(hits) < need:
        return Finding.from_error(
            "trigger",
            errors.TriggerNotExercised(
                f"only {len(hits)} of {len(plans)} turn-2 hits reached a block written during decode (need {need}); "
                "a hit must end past turn 1's prompt",
                hint=_known(history)
                + "keep decode-written checkpoints (--prefix-cache-retention-interval None on vLLM >= 0.29, "
                "VLLM_PREFIX_CACHE_RETENTION_INTERVAL unset before), "
                "check --block-size, or raise --answer-blocks",
            ),
            **figures,
        )
    return Finding.passed(
        "trigger", f"{len(hits)} of {len(plans)} turn-2 hits reached decode-written blocks", **figures
    )


def _known(history: History) -> str:
    """What the treatment's own release and settings explain, first in a hint."""
    said = trigger_hint(history.treatment_info) if history.treatment_info is not None else ""
    return f"{said}; otherwise: " if said else ""


def drafter_live(history: History) -> Finding:
    delta = history.deltas.get(Arm.TREATMENT)
    drafts = delta.value(metrics.DRAFTS) if delta else None
    drafted = delta.value(metrics.DRAFT_TOKENS) if delta else None
    accepted = delta.value(metrics.ACCEPTED) if delta else None
    per_pos = delta.per_label(metrics.ACCEPTED_PER_POS, "position") if delta else {}
    acceptance = {k: v / drafts for k, v in sorted(per_pos.items())} if drafts else {}
    figures = {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_per_position": acceptance,
    }
    if drafts is None:
        return Finding.from_error(
            "drafter-live",
            errors.SpecDecodeNotEngaged(
                "the treatment's /metrics has no speculative-decoding counters",
                hint="start the treatment with --speculative-config (MTP or EAGLE)",
            ),
            **figures,
        )
    if drafts <= 0 or not accepted:
        return Finding.from_error(
            "drafter-live",
            errors.SpecDecodeNotEngaged(
                f"the drafter proposed {drafts:g} drafts and {accepted or 0:g} tokens were accepted",
                hint="check the drafter loaded (server log) and that requests decode long enough",
            ),
            **figures,
        )
    rates = ", ".join(f"pos {k}: {v:.2f}" for k, v in acceptance.items())
    return Finding.passed("drafter-live", f"{drafts:g} drafts, {accepted:g} accepted tokens ({rates})", **figures)


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


def resume_kinds(history: History) -> tuple[str, ...]:
    """turn 2, then the extra resumes the run sent (`--resumes`), in the order each conversation sent them."""
    extra = sorted(
        {e.kind for e in history.exchanges if e.kind.startswith(Kind.RESUME) and not e.kind.endswith("-fresh")},
        key=lambda k: int(k.removeprefix(Kind.RESUME)),
    )
    return (Kind.TURN2, *extra)


Resumed = list[tuple[str, float, bool]]  # a conversation's decode-region resumes: (kind, deviation, differs)


def _resumed(
    history: History, arm: str, plan: Plan, kinds: Sequence[str], hard_margin: float, tokens: int | None
) -> Resumed:
    """Each decode-region resume of one conversation on `arm`, in the order it was sent."""
    out: Resumed = []
    for hit in kinds:
        a, b = history.get(plan.index, arm, hit), history.get(plan.index, arm, Kind.fresh(hit))
        if a is None or b is None or not (a.ok and b.ok and a.tokens and b.tokens):
            continue
        if in_decode_region(plan, a.cached_tokens or 0):
            mine, theirs = a.tokens[:tokens], b.tokens[:tokens]
            out.append((hit, deviation(mine, theirs, hard_margin), mine != theirs))
    return out


@dataclass(frozen=True)
class Maxima:
    """Each conversation scored by its largest deviation over its first `per` decode-region resumes.

    `per` is the count at least half the reference's conversations reach; a reference conversation with fewer is
    left out of the yardstick (its maximum would be over fewer draws, a lower bar), while a treatment conversation
    with fewer keeps what it has (a maximum over fewer draws is stochastically smaller under a correct engine: a
    conservative score, so it costs power and never a false alarm). Leaving out by count alone, never by value,
    keeps the arms exchangeable."""

    treatment: list[Sample]
    reference: list[Sample]
    per: int
    counts: dict[str, dict[int, int]]  # arm -> {decode-region resumes: conversations}
    left_out: list[int]  # reference conversations with fewer than `per`


def resume_maxima(history: History, hard_margin: float, tokens: int | None) -> Maxima:
    kinds = resume_kinds(history)
    rows = {
        arm: {p.index: _resumed(history, arm, p, kinds, hard_margin, tokens) for p in history.plans_of(arm)}
        for arm in (Arm.TREATMENT, Arm.REFERENCE)
    }
    reached = sorted((len(r) for r in rows[Arm.REFERENCE].values() if r), reverse=True)
    per = reached[(len(reached) - 1) // 2] if reached else len(kinds)

    def scored(unit: int, resumed: Resumed) -> Sample:
        first = resumed[:per]
        kind, dev, _ = max(first, key=lambda r: r[1])
        return Sample(unit, kind, dev, any(r[2] for r in first))

    left_out = [u for u, r in rows[Arm.REFERENCE].items() if 0 < len(r) < per]
    return Maxima(
        treatment=[scored(u, r) for u, r in rows[Arm.TREATMENT].items() if r],
        reference=[scored(u, r) for u, r in rows[Arm.REFERENCE].items() if len(r) >= per],
        per=per,
        counts={arm: dict(sorted(Counter(len(r) for r in rows[arm].values()).items())) for arm in rows},
        left_out=left_out,
    )


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
        return not_used(
            c.check,
            "needs a reference server (the treatment's flags without speculative decoding): without one this run "
            f"cannot measure how far a correct engine's {c.region} hits deviate from recomputation",
        )
    n = compared_positions(history, grading)
    if c is LOGPROB and len(resume_kinds(history)) > 1:
        return _maxima_versus_reference(history, grading, n, alpha)
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
        return not_used(c.check, why)
    found = _strata(c, strata, graded, alpha, len(history.plans), grading.yardstick_assumed)
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


def _maxima_versus_reference(history: History, grading: Grading, n: int, alpha: float) -> Finding:
    """Several resumes a conversation (`--resumes`): one sample a conversation, its largest deviation."""
    m = resume_maxima(history, grading.hard_margin, n)
    figures = {
        "compared_positions": n,
        "resumes_per_conversation": m.per,
        "decode_region_resumes": m.counts,
        "yardstick_left_out": m.left_out,
    }
    if not (m.treatment and m.reference):
        why = f"no decode-region resumes to compare (treatment {len(m.treatment)}, reference {len(m.reference)})"
        return replace(not_used(LOGPROB.check, why), figures=figures)
    worst = sorted(m.treatment, key=lambda s: -s.deviation)[:5]
    found = judge_samples(
        LOGPROB.check,
        m.treatment,
        m.reference,
        alpha=alpha,
        what=f"treatment conversations (each its largest deviation over {m.per} decode-region resumes)",
        against="the reference's",
        assumed=grading.yardstick_assumed,
        runs=len(history.plans),
        hint=f"replay conversations {[s.unit for s in worst]} (the largest deviations) from the run folder's replay/",
    )
    return _per_resume(replace(found, figures={**found.figures, **figures}), m.per)


def _per_resume(found: Finding, per: int) -> Finding:
    """A PASS over conversation maxima speaks of conversations. Where boundaries fail independently (a poisoned
    block, a checkpoint written inside an accepted draft), the same power covers a smaller fraction of resumes; say
    both, under that assumption, so that `--detect` (a fraction of hits) can use it. Corruption that strikes every
    boundary of a conversation together is covered only at the conversation fraction."""
    q = found.figures.get("detectable_fraction")
    if found.status is not Status.PASS or q is None or per < 2:
        return found
    p = stats.each_fraction(float(q), per)
    reason = (
        f"{found.reason}; where each boundary fails on its own, that is corruption in >= {p:.0%} of decode-region "
        f"resumes ({per} a conversation), where they fail together only the conversation fraction holds"
    )
    return replace(found, reason=reason, figures={**found.figures, "detectable_fraction_of_resumes": p})


def _strata(
    c: _Comparison,
    strata: dict[str, tuple[list[Sample], list[Sample]]],
    graded: list[str],
    alpha: float,
    runs: int,
    assumed: Sequence[str],
) -> dict[str, Finding]:
    """Each graded stratum at its share; one that cannot reach significance at it drops out and the rest are run
    again at the larger share (as `grade` does over graders). The last stratum left is kept either way."""
    while True:
        found = {kind: _judge(c, kind, *strata[kind], alpha / len(graded), runs, assumed) for kind in graded}
        usable = [k for k, f in found.items() if f.status in (Status.PASS, Status.FAIL)]
        if len(graded) == 1 or usable == graded:
            return found
        graded = usable or graded[:1]


def _judge(
    c: _Comparison, kind: str, t: list[Sample], r: list[Sample], alpha: float, runs: int, assumed: Sequence[str]
) -> Finding:
    worst = sorted(t, key=lambda s: -s.deviation)[:5]
    what = f"treatment {c.region} hits" if len(c.pairs) == 1 else f"treatment {c.region} {_NAMES[kind]} hits"
    return judge_samples(
        c.check,
        t,
        r,
        alpha=alpha,
        what=what,
        against="the reference's",
        assumed=assumed,
        runs=runs,
        hint=f"replay conversations {[s.unit for s in worst]} (the largest deviations) from the run folder's replay/",
    )


_NAMES = {Kind.PROBE: "probe", Kind.TURN2: "turn-2"}


def _ungraded(counts: dict[str, int]) -> str:
    kinds = ", ".join(f"{n} {_NAMES[kind]}" for kind, n in counts.items())
    return f"not graded: {kinds} hits of the treatment, which the reference has none of to compare with"


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
        return not_used("recall", "no conversation has a decode-region hit with its no-reuse and control answers")
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


def _indices(config: RunConfig, has_reference: bool, units: tuple[int, int] | None) -> tuple[range, range]:
    """Treatment conversations to drive, and the reference's extras that go with them (numbered from
    `config.yardstick_base`, past every treatment conversation)."""
    start, stop = units if units is not None else (0, config.conversations)
    if not has_reference:
        return range(start, stop), range(0)
    extra = config.reference_ratio - 1
    base = config.yardstick_base
    return range(start, stop), range(base + extra * start, base + extra * stop)


async def _multiturn(
    config: RunConfig,
    endpoints: Mapping[str, Endpoint],
    geo: Geometry,
    salt: str,
    record: Record,
    progress: Progress,
    units: tuple[int, int] | None = None,
) -> tuple[list[Plan], list[Plan], list[Exchange]]:
    """Every arm runs the treatment's conversations; the reference alone runs the yardstick's extras as well."""
    own, extras = _indices(config, Arm.REFERENCE in endpoints, units)
    total = len(own) + len(extras)
    progress(0, total, f"sizing prompts and sending (block {geo.block_size} tokens)")
    count = endpoints[Arm.TREATMENT].count_tokens

    # Interleaved (0, n, 2n, 1, n+1, ...) so the treatment is not left idle while the reference runs its extras.
    def slot(i: int) -> tuple[int, int]:
        k = i - own.start if i in own else i - extras.start
        return (k % len(own), 0 if i in own else 1 + k // len(own))

    order = sorted((*own, *extras), key=slot)
    # Each prompt is sized (a binary search over /tokenize) ahead of its turn, in sending order, while earlier
    # conversations run: sized all first, the servers sat idle for it (3.5 s of a 160 s CPU run).
    sizing = asyncio.Semaphore(config.concurrency * 2)

    async def size(i: int) -> Plan:
        async with sizing:
            return await plan_conversation(i, config.seed, config.shape, geo.block_size, geo.max_model_len, count)

    plans = {i: asyncio.ensure_future(size(i)) for i in order}
    done = 0

    async def one(i: int) -> list[Exchange]:
        nonlocal done
        try:
            plan = await plans[i]
        except Exception:  # raised below, after the others have ended: none is left sending
            return []
        out = await _conversation(config, endpoints, plan, salt, record, geo.block_size)
        done += 1
        progress(done, total, f"conversation {plan.index} done")
        return out

    try:
        results = await gather_bounded(config.concurrency, *(one(i) for i in order))
    finally:  # on cancellation, the prompts not yet sized are cancelled too
        for task in plans.values():
            task.cancel()
        await asyncio.gather(*plans.values(), return_exceptions=True)
    sized = {i: plans[i].result() for i in order}  # the first prompt that could not be sized, in sending order
    return [sized[i] for i in own], [sized[i] for i in extras], [e for r in results for e in r]


async def _conversation(
    config: RunConfig,
    endpoints: Mapping[str, Endpoint],
    plan: Plan,
    salt: str,
    record: Record,
    block_size: int,
) -> list[Exchange]:
    shape, conv = config.shape, plan.index

    async def ask(arm: str, kind: str, body: dict[str, object]) -> Exchange:
        return record(await endpoints[arm].chat(body, conversation=conv, kind=kind))

    def fresh(kind: str) -> str:
        return f"{salt}-{conv}-{kind}-fresh"

    async def resumed(arm: str) -> list[Exchange]:
        """Turn 1 on `arm`, then turn 2 on its own answer: hit first, then the same prompt with no reuse."""
        t1 = await ask(arm, Kind.TURN1, {**turn1_body(plan, shape), "cache_salt": salt})
        if not t1.ok:
            return [t1]
        m2 = turn2_messages(plan, t1.text)
        # The control needs only turn 1's answer: sent now, it runs beside the treatment's chain, not after it.
        control = (
            asyncio.create_task(ask(Arm.CONTROL, Kind.TURN2, turn2_body(m2, shape, salt=salt)))
            if arm == Arm.TREATMENT and Arm.CONTROL in endpoints
            else None
        )
        try:
            out = [t1, await ask(arm, Kind.TURN2, turn2_body(m2, shape, salt=salt))]
            out.append(await ask(arm, Kind.TURN2_FRESH, turn2_body(m2, shape, salt=fresh(Kind.TURN2))))
            # Extra resumes: the answer cut a block, two blocks, ... earlier, so each hit lands on another
            # decode-written boundary of the same turn 1 (sent after turn 2, whose prefill writes only above them).
            words = [t.token for t in t1.tokens]
            for j, keep in enumerate(shape.resume_cuts(block_size), start=1):
                m = turn2_messages(plan, resume_cut(t1.text, words, keep))
                out.append(await ask(arm, Kind.resume(j), turn2_body(m, shape, salt=salt)))
                out.append(await ask(arm, Kind.fresh(Kind.resume(j)), turn2_body(m, shape, salt=fresh(Kind.resume(j)))))
            # The probe's hit ends in the prefill-written region; on the reference it measures whether this engine
            # is bit-exact there, so exactness is demanded only where it was measured.
            out.append(await ask(arm, Kind.PROBE, turn2_body(plan.probe_messages, shape, salt=salt, probe=True)))
            out.append(
                await ask(
                    arm, Kind.PROBE_FRESH, turn2_body(plan.probe_messages, shape, salt=fresh(Kind.PROBE), probe=True)
                )
            )
            if control is not None:
                out.append(await control)
            return out
        finally:
            if control is not None and not control.done():  # a chain that raised leaves no request behind
                control.cancel()

    if conv >= config.yardstick_base:  # a yardstick conversation: the reference's alone
        return await resumed(Arm.REFERENCE)
    chains = [resumed(Arm.TREATMENT)]
    if Arm.REFERENCE in endpoints:
        chains.append(resumed(Arm.REFERENCE))
    return [e for chain in await asyncio.gather(*chains) for e in chain]


GRADER_FUNCTIONS: dict[str, GraderFunction] = {"exactness": exactness, "recall": recall, "logprob": logprob}
# Exactness judges prefill-region hits, not the decode-written blocks the trigger proved.
COVERS_TRIGGER = {"exactness": False, "recall": True, "logprob": True}


class Multiturn(Probe):
    name = "multiturn"
    about = "decode-written blocks re-used by turn 2 (default)"

    async def drive(self, ctx: DriveContext) -> Driven:
        config = ctx.config
        plans, yardstick, found = await _multiturn(
            config, ctx.endpoints, ctx.geometry, ctx.salt, ctx.record, ctx.progress, ctx.units
        )
        if ctx.units is None:  # a run in rounds: the engine writes every round's plans so far
            ctx.store.write_plans(plans, yardstick)
        return Driven(exchanges=tuple(found), plans=tuple(plans), yardstick=tuple(yardstick))

    def gates(self, history: History, grading: Grading) -> list[Finding]:
        return [trigger(history, grading), drafter_live(history)]

    def graders(self, grading: Grading) -> list[Grader]:
        # Looked up at each call, so a test can put a grader of its own in GRADER_FUNCTIONS.
        return [Grader(n, GRADER_FUNCTIONS[n], COVERS_TRIGGER[n]) for n in (grading.graders or GRADERS)]

    def required(self, grading: Grading) -> frozenset[str]:
        return frozenset(grading.graders)


MULTITURN = Multiturn()
