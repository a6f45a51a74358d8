"""A run that stops when the answer is known (`blackbox.sequential`): its schedule, its stopping rule on
hand-built histories through `engine.judge`, a stored run judged again look by look, and its size under the
null by simulation (20 000 runs, with the looks in place)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import run_folders as rf

from blackbox import evidence, metrics, sequential
from blackbox.config import RunConfig
from blackbox.engine import judge, rejudge
from blackbox.errors import UsageError
from blackbox.history import Arm, Exchange, History, Kind
from blackbox.verdict import Finding, Status, Verdict, merge

import histories as h
import nulls

MAX, ROUND = 64, 16
SCHEDULE = sequential.Schedule(ROUND, MAX, 0.01, ratio=2)


def config(detect: float, **changes: object) -> RunConfig:
    return dataclasses.replace(rf.CONFIG, detect=detect, round_conversations=ROUND, max_conversations=MAX, **changes)


def history(treatment: list[float], *, flips: tuple[int, ...] = ()) -> History:
    """`len(treatment)` conversations sent of a schedule of MAX: the reference ran each of them and one extra per
    conversation, numbered from MAX (as the engine numbers them), every reference and probe hit a little off."""
    sent = len(treatment)
    reference = rf.noise(2 * MAX, base=0.0025)
    yardstick = list(SCHEDULE.yardstick_range(0, sent))
    exchanges: list[Exchange] = []
    for conv in [*range(sent), *yardstick]:
        arms = [(Arm.REFERENCE, reference[conv % (2 * MAX)], False)]
        if conv < sent:
            arms.insert(0, (Arm.TREATMENT, treatment[conv], conv in flips))
        for arm, shift, flip in arms:
            exchanges.append(h.exchange(conv, arm, Kind.TURN1, cached=0, text="a long story"))
            exchanges += rf._pair(conv, arm, shift, flip, kind=Kind.TURN2, cached=h.DECODE_HIT)
            exchanges += rf._pair(
                conv, arm, reference[(conv * 5) % MAX] / 2, False, kind=Kind.PROBE, cached=h.PROMPT_HIT
            )
        if conv < sent:
            exchanges.append(h.exchange(conv, Arm.CONTROL, Kind.TURN2, text=h.ANSWER))
    quiet = {metrics.CACHE_QUERIES: 8000, metrics.CACHE_HITS: 2400}
    deltas = {
        Arm.TREATMENT: h.live_delta(),
        Arm.CONTROL: h.delta(h.zeros({metrics.CACHE_QUERIES: 0}), {metrics.CACHE_QUERIES: 4000}),
        Arm.REFERENCE: h.delta(h.zeros(quiet), quiet),
    }
    plans = tuple(h.plan(i) for i in range(sent))
    return History(h.BLOCK, plans, tuple(exchanges), deltas, yardstick=tuple(h.plan(i) for i in yardstick))


def sequential_finding(verdict: Verdict) -> Finding:
    return next(f for f in verdict.findings if f.check == "sequential")


def test_the_schedule_spends_alpha_over_its_looks_and_no_more() -> None:
    s = sequential.Schedule(16, 70, 0.01)
    assert s.looks == (16, 32, 48, 64, 70)
    assert math.isclose(sum(s.level(k) for k in range(1, 6)), 0.01)
    assert s.level(5) < s.level(1)  # the last, short round adds less information
    # The reference's extras come after every treatment conversation, the same ones at every look.
    assert list(sequential.Schedule(16, 64, 0.01, ratio=3).yardstick_range(16, 32)) == list(range(96, 128))


def test_a_plan_spends_most_of_alpha_by_the_look_where_a_correct_engine_is_expected_to_pass() -> None:
    # Rounds of 8 up to 160: 20 looks. --detect 0.2 over 3 resumes is a conversation fraction of 49%, which 24
    # conversations against 48 reference ones can promise at 80% of alpha over three looks (0.00267 each, split over
    # two graders' three tests: critical count 8, 95% power at 48%); 16 cannot at any level (critical 7 of 16).
    base = sequential.Schedule(8, 160, 0.01, ratio=2)
    assert sequential.planned_look(0.2, 3, base) == 3
    plan = dataclasses.replace(base, planned=3)
    levels = [plan.level(k) for k in range(1, len(plan.looks) + 1)]
    assert math.isclose(sum(levels), 0.01) and math.isclose(sum(levels[:3]), 0.8 * 0.01)
    assert levels[0] == levels[2] > 20 * levels[3]  # 0.00267 by the plan, 0.000118 a look after it
    assert "80% spent by look 3" in plan.describe()
    # The plan is where such a run passes; before plans, rounds of 16 spent linearly passed at 32 (measured so).
    assert sequential.expected_pass_look(0.2, 3, plan) == 3
    assert sequential.expected_pass_look(0.2, 3, sequential.Schedule(16, 160, 0.01, ratio=2)) == 2
    # Fewer resumes need more conversations for the same fraction of hits; what no look can promise is no plan.
    assert sequential.planned_look(0.2, 1, base) == 9 and sequential.planned_look(0.01, 1, base) == 0
    assert dataclasses.replace(base, planned=0).level(1) == 0.01 * 8 / 160
    # A run stored before the plan (no plan_share in its config.json) is judged again at the linear levels it ran
    # at; one stored after keeps its plan.
    stored = RunConfig(treatment="http://127.0.0.1:1", detect=0.2).to_json()
    assert RunConfig.from_json(stored).schedule == RunConfig(treatment="http://127.0.0.1:1", detect=0.2).schedule
    old = RunConfig.from_json({k: v for k, v in stored.items() if k != "plan_share"}).schedule
    assert old is not None and old.planned == 0 and old.level(1) == 0.01 * 8 / 160
    # The configuration plans it: the graders named split the level further.
    assert RunConfig(treatment="http://127.0.0.1:1", detect=0.2).schedule == dataclasses.replace(
        base, ratio=RunConfig.reference_ratio, planned=sequential.planned_look(0.2, 1, base)
    )


def test_a_clean_run_that_reaches_the_planned_look_passes_there_at_the_planned_level() -> None:
    clean = history(rf.noise(MAX))
    detect = 0.45  # one resume a conversation: promised at 32 conversations (look 2), not at 16
    plan = config(detect).schedule
    assert plan is not None and plan.planned == 2
    verdict, _ = judge(clean, config(detect), rf.ROLES)
    seq = sequential_finding(verdict)
    assert verdict.status is Status.PASS and seq.figures["stopped_at_look"] == 2
    assert seq.figures["planned_pass_look"] == 2 and math.isclose(seq.figures["looks"][1]["alpha"], 0.8 * 0.01 / 2)
    assert "80% spent by look 2, where a PASS was planned" in verdict.reason


def test_a_dense_fault_fails_at_the_first_look() -> None:
    verdict, _ = judge(history([0.9] * MAX), config(0.2), rf.ROLES)
    assert (verdict.status, verdict.exit_code, verdict.error_class) == (Status.FAIL, 1, "CorruptionDetected")
    seq = sequential_finding(verdict)
    assert seq.figures["stopped_at_look"] == 1 and seq.figures["conversations"] == ROUND
    assert "look 1 of 4" in verdict.reason and f"alpha {0.01 * ROUND / MAX:.3g}" in verdict.reason


def test_a_clean_run_passes_once_it_covers_what_was_asked_and_sends_no_round_more() -> None:
    clean = history(rf.noise(MAX))
    unreachable, _ = judge(clean, config(0.05), rf.ROLES)  # every look, each with the coverage it had
    looks = [x["coverage"] for x in sequential_finding(unreachable).figures["looks"]]
    assert all(q is not None for q in looks) and looks == sorted(looks, reverse=True)  # coverage grows with n
    detect = (looks[1] + looks[2]) / 2  # reached at look 3, not before
    verdict, _ = judge(clean, config(detect), rf.ROLES)
    assert verdict.status is Status.PASS and verdict.exit_code == 0
    seq = sequential_finding(verdict)
    assert seq.figures["stopped_at_look"] == 3 and [x["stop"] for x in seq.figures["looks"]] == [False, False, True]
    assert "look 3 of 4" in verdict.reason


def test_a_budget_that_ends_short_of_the_coverage_is_unknown_and_says_how_many_would_do() -> None:
    verdict, _ = judge(history(rf.noise(MAX)), config(0.05), rf.ROLES)
    assert (verdict.status, verdict.exit_code, verdict.error_class) == (Status.UNKNOWN, 2, "InsufficientPower")
    seq = sequential_finding(verdict)
    assert seq.figures["stopped_at_look"] == 4 and not seq.figures["looks"][-1]["stop"]
    assert seq.figures["more_needed"] > MAX and f"about {seq.figures['more_needed']}" in verdict.reason
    assert "--max-conversations" in verdict.hint


def test_a_run_cut_short_by_its_deadline_is_judged_on_the_looks_it_reached() -> None:
    verdict, _ = judge(history(rf.noise(2 * ROUND)), config(0.05), rf.ROLES)
    assert verdict.error_class == "InsufficientPower" and sequential_finding(verdict).figures["stopped_at_look"] == 2


def test_a_failed_gate_stops_the_run_at_once() -> None:
    dead = dataclasses.replace(
        history(rf.noise(MAX)), deltas={**history([0.0]).deltas, Arm.TREATMENT: h.live_delta(CACHE_HITS=0)}
    )
    verdict, _ = judge(dead, config(0.05), rf.ROLES)
    assert verdict.error_class == "CacheNotLive" and sequential_finding(verdict).figures["stopped_at_look"] == 1


def test_only_what_more_conversations_can_mend_sends_another_round() -> None:
    def grader(status: Status, error_class: str | None, q: float | None = None) -> Finding:
        return Finding(
            "logprob", status, "", {"detectable_fraction": q}, error_class, stage="grader", covers_trigger=True
        )

    gate = Finding.passed("trigger", "hits reached decode-written blocks")
    assert not sequential.stops(merge([gate, grader(Status.UNKNOWN, "InsufficientPower")]), 0.2)
    assert not sequential.stops(merge([gate, grader(Status.PASS, None, 0.3)]), 0.2)
    assert sequential.stops(merge([gate, grader(Status.PASS, None, 0.2)]), 0.2)
    assert sequential.stops(merge([gate, grader(Status.UNKNOWN, "ControlQualityFailure")]), 0.2)
    assert sequential.stops(merge([gate, grader(Status.UNKNOWN, "GraderCrashed")]), 0.2)
    assert sequential.stops(merge([gate, grader(Status.FAIL, "CorruptionDetected")]), 0.2)
    failed_gate = Finding("trigger", Status.UNKNOWN, "no hit reached", {}, "TriggerNotExercised")
    assert sequential.stops(merge([failed_gate, grader(Status.UNKNOWN, "InsufficientPower")]), 0.2)


def test_a_look_sees_only_its_conversations() -> None:
    full = history([0.9 if i >= ROUND else 0.0 for i in range(MAX)])  # corruption only after the first round
    first = sequential.subset(full, SCHEDULE, ROUND)
    assert [p.index for p in first.plans] == list(range(ROUND))
    assert [p.index for p in first.yardstick] == list(range(MAX, MAX + ROUND))
    assert {e.conversation for e in first.exchanges} == set(range(ROUND)) | set(range(MAX, MAX + ROUND))
    verdict, _ = judge(full, config(0.05), rf.ROLES)
    assert verdict.status is Status.FAIL and sequential_finding(verdict).figures["stopped_at_look"] == 2


def test_a_stored_run_is_judged_again_to_the_same_look(tmp_path: Path) -> None:
    cfg = config(0.05)
    folder = rf.write(tmp_path, "seq", history([0.9 if i >= ROUND else 0.0 for i in range(2 * ROUND)]), cfg)
    again = rejudge(folder)
    assert again.config.detect == 0.05 and again.verdict.status is Status.FAIL
    assert sequential_finding(again.verdict).figures["stopped_at_look"] == 2
    assert rf.stored_verdict(folder)["status"] == "FAIL"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"detect": 1.0}, "--detect"),
        ({"detect": 0.2, "max_conversations": 8}, "--max-conversations must be at least --round"),
        ({"detect": 0.2, "probes": ("cold-race",)}, "needs the multiturn probe"),
    ],
)
def test_a_schedule_that_cannot_run_is_refused_before_anything_is_sent(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        dataclasses.replace(rf.CONFIG, round_conversations=16, **changes)


# The null simulation: a correct engine, one hit per conversation on each arm's own draws, the reference two per
# conversation. Stopping for a PASS only ends runs that could still have read FAIL, so "FAIL at any look" bounds
# the false-alarm rate of every PASS rule; that is what is counted.
RUNS = 20_000
ALPHA = 0.01
SLACK = 3 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS)


def _false_alarms(
    levels: list[float], looks: tuple[int, ...], rng: np.random.Generator, margin: float = evidence.MARGIN
) -> np.ndarray:
    """Per simulated run and look, whether that look's rule read FAIL."""
    n = looks[-1]
    # Half-normal deviations with 2% confident flips on both arms (a correct engine with some near-ties).
    x = np.abs(rng.normal(0, 0.01, size=(RUNS, n)))
    y = np.abs(rng.normal(0, 0.01, size=(RUNS, 2 * n)))
    x[rng.random(x.shape) < 0.02] = math.inf
    y[rng.random(y.shape) < 0.02] = math.inf
    return np.stack(
        [nulls.fails(x[:, :k], y[:, : 2 * k], level, margin) for level, k in zip(levels, looks, strict=True)], 1
    )


def test_the_sequential_rule_keeps_its_false_alarm_rate_where_looking_at_full_alpha_does_not() -> None:
    schedule = sequential.Schedule(16, 96, ALPHA, ratio=2)
    levels = [schedule.level(k) for k in range(1, len(schedule.looks) + 1)]
    spent = float(_false_alarms(levels, schedule.looks, np.random.default_rng(24)).any(axis=1).mean())
    # A plan puts 80% of alpha on the first two looks; the union bound holds it to alpha all the same.
    plan = dataclasses.replace(schedule, planned=2)
    planned = [plan.level(k) for k in range(1, len(plan.looks) + 1)]
    by_plan = float(_false_alarms(planned, plan.looks, np.random.default_rng(25), 1.0).any(axis=1).mean())
    # The graders' 1.25x margin makes each look conservative under this null, which would hide what optional
    # stopping does; the same tests at their exact level (margin 1) show it, and the looks' shares hold them too.
    exact = float(_false_alarms(levels, schedule.looks, np.random.default_rng(24), 1.0).any(axis=1).mean())
    each = _false_alarms([ALPHA] * len(schedule.looks), schedule.looks, np.random.default_rng(24), 1.0)
    naive, fixed = float(each.any(axis=1).mean()), float(each[:, -1].mean())
    print(
        f"false alarms: {spent:.4f} spent over the looks ({exact:.4f} at the exact level); at the whole alpha: "
        f"{naive:.4f} over them, {fixed:.4f} once; {by_plan:.4f} with 80% spent by look 2 (exact level)"
    )
    # Measured (2026-12-05): 0.0003 spent over 6 looks (0.0050 at the exact level), 0.0050 with 80% spent by look
    # 2; 0.0229 looking at the whole alpha each time, 0.0067 for one look at it.
    assert spent <= ALPHA + SLACK and exact <= ALPHA + SLACK and by_plan <= ALPHA + SLACK
    # The simulation sees what optional stopping does: looking six times at a fixed level fails far more often
    # than looking once; the looks' shares are what keeps the rate under alpha.
    assert naive > 2 * fixed + SLACK
