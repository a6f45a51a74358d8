"""The hit-geometry sweep: where a prompt ends inside a block, and whether a repeat of it hits.

Silent 0% hit regions are bugs users reported even where no output was wrong: MTP costing every hit on 0.28.1rc1
(#54360), hits of max(0, floor((L-1)/U) - 1) * U on 0.28.0, a checkpoint placed in request-unique tokens (#45238),
prompts "too short" to hit (#40696, #53749). They also leave the other probes blind where they hit nothing.

Plans (seeded by run seed and prompt index, documents as the other probes'): one prompt per offset class inside a
block (1, 1/8, 1/4, 1/2, 3/4 of a block and one token short of the next boundary) at each of several block
multiples, each sent twice on its own cache_salt; the second send's cached_tokens is the hit. The most a correct
engine can hit is every full block of the prompt but its last token (which must be recomputed for the logits),
less one block when the treatment speculates (the drafter's lookahead drops the last matched block):
`ceiling(L) = max(0, floor((L - 1) / B) - drop) * B`.

Trigger proof (`hit-geometry`): repeats hit, and no offset class whose ceiling is above 0 hits nothing while others
hit. A class that does is the finding, and the summary names its offsets; it is UNKNOWN (`CacheNotLive`), not
FAIL: no answer was shown wrong, but the other probes' coverage there is nil.

Grader (`sweep-exactness`): each repeat (a hit) against its first send (computed cold), treatment against the
same on the reference, with the statistics every grader shares; the hits end in the prefill-written region. Only
repeats whose recomputed tail fits one scheduler step are graded (`_samples`: the arms' tails differ by the drafter's
drop, so a budget that cuts them makes a correct engine's arms unlike).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from blackbox import errors, metrics
from blackbox.client import gather_bounded
from blackbox.compare import deviation
from blackbox.config import Grading
from blackbox.evidence import Sample, judge_samples
from blackbox.history import Arm, Exchange, History, Plan
from blackbox.probes.base import DriveContext, Driven, Grader, Probe, compared_positions, not_used, with_positions
from blackbox.verdict import Finding
from blackbox.workload import Shape, plan_conversation

__all__ = ["FIRST", "HIT_GEOMETRY", "HitGeometry", "ceiling", "offsets", "sweep"]

FIRST = 30_000  # conversation id of the first sweep prompt
MULTIPLES = (2, 3, 4)  # whole blocks below the prompt's end
FRACTIONS = (0.0, 1 / 8, 1 / 4, 1 / 2, 3 / 4)  # of a block past them (0: one token past the boundary)
ANSWER_TOKENS = 8
FIRST_SEND, REPEAT = "sweep-1", "sweep-2"


def offsets(block_size: int) -> tuple[int, ...]:
    """The offset classes inside a block: tokens past a boundary where a prompt ends."""
    return tuple(sorted({max(1, round(f * block_size)) for f in FRACTIONS} | {block_size - 1}))


def ceiling(prompt_tokens: int, block_size: int, drop: int) -> int:
    """The longest hit a correct engine can give a repeat of a prompt of `prompt_tokens`."""
    return max(0, (prompt_tokens - 1) // block_size - drop) * block_size


class HitGeometry(Probe):
    name = "hit-geometry"
    about = "prompts ending at every offset class inside a block, each sent twice: which ones hit"

    async def drive(self, ctx: DriveContext) -> Driven:
        geo, config = ctx.geometry, ctx.config
        wanted = [(k, o) for k in MULTIPLES for o in offsets(geo.block_size)]
        ctx.progress(0, len(wanted), "hit-geometry sweep")
        count = ctx.treatment.count_tokens
        plans: list[Plan] = await gather_bounded(
            config.concurrency * 2,
            *(
                plan_conversation(
                    FIRST + i,
                    config.seed,
                    Shape(prompt_blocks=k + 1, margin=geo.block_size - o, answer_blocks=1),
                    geo.block_size,
                    geo.max_model_len,
                    count,
                )
                for i, (k, o) in enumerate(wanted)
            ),
        )
        arms = [a for a in (Arm.TREATMENT, Arm.REFERENCE) if a in ctx.endpoints]

        async def twice(plan: Plan, arm: str) -> list[Exchange]:
            body = {
                "messages": list(plan.turn1_messages),
                "temperature": 0.0,
                "logprobs": True,
                "top_logprobs": config.shape.top_logprobs,
                "max_tokens": max(ANSWER_TOKENS, config.grading.compare_tokens or 0),
                "cache_salt": f"{ctx.salt}-sweep-{plan.index}",
            }
            endpoint = ctx.endpoints[arm]
            return [
                ctx.record(await endpoint.chat(body, conversation=plan.index, kind=k)) for k in (FIRST_SEND, REPEAT)
            ]

        found = await gather_bounded(config.concurrency, *(twice(p, a) for p in plans for a in arms))
        rows = [
            {"index": p.index, "multiple": k, "offset": o, "prompt_tokens": p.turn1_prompt_tokens}
            for p, (k, o) in zip(plans, wanted, strict=True)
        ]
        return Driven(exchanges=tuple(e for pair in found for e in pair), data={"prompts": rows})

    def gates(self, history: History, grading: Grading) -> list[Finding]:
        return [sweep(history)]

    def graders(self, grading: Grading) -> list[Grader]:
        return [Grader("sweep-exactness", grade, covers_trigger=True)]

    def required(self, grading: Grading) -> frozenset[str]:
        return frozenset({"sweep-exactness"})


def _rows(history: History) -> list[Mapping[str, Any]]:
    return list((history.extras.get(HitGeometry.name) or {}).get("prompts", ()))


def _drop(history: History) -> int:
    """One block when the treatment speculated during the run (its drafter proposed), else none."""
    delta = history.deltas.get(Arm.TREATMENT)
    drafts = delta.value(metrics.DRAFTS) if delta else None
    return 1 if drafts else 0


def sweep(history: History) -> Finding:
    block, drop = history.block_size, _drop(history)
    by_offset: dict[int, list[tuple[int, int | None, int]]] = defaultdict(list)  # offset -> (L, hit, ceiling)
    for row in _rows(history):
        e = history.get(int(row["index"]), Arm.TREATMENT, REPEAT)
        hit = e.cached_tokens if e is not None and e.ok else None
        length = int(row["prompt_tokens"])
        by_offset[length % block or block].append((length, hit, ceiling(length, block, drop)))
    table = {
        o: {"prompt_tokens": [r[0] for r in rs], "hit": [r[1] for r in rs], "ceiling": [r[2] for r in rs]}
        for o, rs in sorted(by_offset.items())
    }
    figures: dict[str, Any] = {"block_size": block, "drop_blocks": drop, "by_offset": table}
    reachable = {o: [r for r in rs if r[2] > 0] for o, rs in by_offset.items()}
    hitting = sorted(o for o, rs in reachable.items() if any(r[1] for r in rs))
    dead = sorted(o for o, rs in reachable.items() if rs and not any(r[1] for r in rs))
    over = [(o, r) for o, rs in by_offset.items() for r in rs if r[1] is not None and r[1] > r[2]]
    figures |= {"offsets_hitting": hitting, "offsets_dead": dead, "over_ceiling": over}
    if not any(r[1] is not None for rs in by_offset.values() for r in rs):
        return Finding.from_error(
            "hit-geometry",
            errors.TriggerNotExercised(
                "the treatment reported no usage.prompt_tokens_details.cached_tokens for the sweep",
                hint="start the treatment with --enable-prompt-tokens-details",
            ),
            **figures,
        )
    if not hitting:
        return Finding.from_error(
            "hit-geometry",
            errors.CacheNotLive(
                f"no repeated prompt hit the cache at any offset inside a {block}-token block",
                hint="is prefix caching on (--enable-prefix-caching --mamba-cache-mode align)? a known regression "
                "drops hybrid hits to 0 under MTP (vLLM #54360)",
            ),
            **figures,
        )
    if dead:
        return Finding.from_error(
            "hit-geometry",
            errors.CacheNotLive(
                f"repeats of prompts ending {dead} tokens past a block boundary hit nothing while those ending "
                f"{hitting} tokens past one hit: a silent hit-rate regression at those offsets (vLLM #54360, #45238)",
                hint="the other probes cannot see corruption where nothing hits: compare the offsets with the "
                "server's block size and speculative config (figures by_offset)",
            ),
            **figures,
        )
    return Finding.passed(
        "hit-geometry",
        f"repeats hit at every offset class inside a {block}-token block ({', '.join(map(str, hitting))} tokens "
        f"past a boundary)",
        **figures,
    )


def step_budget(history: History) -> int | None:
    """The treatment's max_num_batched_tokens: published (/server_info), else as the user stated it."""
    info = history.treatment_info
    published = info.settings.get("max_num_batched_tokens") if info is not None else None
    if published is not None and published.isdigit():
        return int(published)
    return history.step_budget


def _samples(
    history: History, arm: str, hard_margin: float, tokens: int, budget: int | None
) -> tuple[list[Sample], list[Sample]]:
    """Each repeat that hit, against its cold first send: those whose recomputed tail (prompt less hit) fits in one
    step, and those whose tail the step budget cuts (none without a known budget). On an engine that is not
    bit-exact the cut alone can make a repeat differ from its cold send, and the treatment's tails are a block longer
    than the reference's (the drafter drops the last matched block), so a small budget cuts the treatment's where it
    leaves the reference's whole: the arms are then not alike, and a correct engine read as corrupt (measured on
    cpu-tiny-fragmented, budget 96: bench/results/new-probes.md)."""
    fits: list[Sample] = []
    cut: list[Sample] = []
    for row in _rows(history):
        index = int(row["index"])
        hit, cold = history.get(index, arm, REPEAT), history.get(index, arm, FIRST_SEND)
        if hit is None or cold is None or not (hit.ok and cold.ok and hit.tokens and cold.tokens):
            continue
        if hit.cached_tokens:
            mine, theirs = hit.tokens[:tokens], cold.tokens[:tokens]
            tail = hit.prompt_tokens - hit.cached_tokens if hit.prompt_tokens is not None else 0
            (cut if budget is not None and tail > budget else fits).append(
                Sample(index, REPEAT, deviation(mine, theirs, hard_margin), mine != theirs)
            )
    return fits, cut


def grade(history: History, grading: Grading, alpha: float) -> Finding:
    if Arm.REFERENCE not in history.arms():
        return not_used(
            "sweep-exactness",
            "needs a reference server (the treatment's flags without speculative decoding) to measure how far a "
            "correct engine's hits deviate from their cold first send",
        )
    n = compared_positions(history, grading)
    budget = step_budget(history)
    t, t_cut = _samples(history, Arm.TREATMENT, grading.hard_margin, n, budget)
    r, r_cut = _samples(history, Arm.REFERENCE, grading.hard_margin, n, budget)
    cut = (
        f"; not graded: {len(t_cut)} treatment and {len(r_cut)} reference repeats whose recomputed tail the step "
        f"budget ({budget} tokens) cuts, which differ from their cold send on a correct engine that is not "
        "bit-exact, by how the cut falls (the treatment's tails are a block longer: the drafter drops the last "
        "matched block)"
        if t_cut or r_cut
        else ""
    )
    if not t or not r:
        return not_used(
            "sweep-exactness",
            f"no repeats hit to compare (treatment {len(t)}, reference {len(r)} whose tail fits one step){cut}",
        )
    found = judge_samples(
        "sweep-exactness",
        t,
        r,
        alpha=alpha,
        what="treatment sweep repeats (hits)",
        against="the reference's",
        assumed=grading.yardstick_assumed,
        runs=len(_rows(history)),
        hint="replay the listed sweep prompts from the run folder's replay/",
        run_unit="sweep prompts",
    )
    figures = {**found.figures, "step_budget": budget, "cut_tails": {"treatment": len(t_cut), "reference": len(r_cut)}}
    return with_positions(n, replace(found, reason=found.reason + cut, figures=figures))


HIT_GEOMETRY = HitGeometry()
