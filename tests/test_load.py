"""The load probe's trigger proof (preemptions, evictions, decode-region hits under load) and grader, on hand-built
histories (blocks of 16 tokens, turn 1's prompt 44)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from blackbox import gates, graders
from blackbox.config import Grading
from blackbox.history import Arm, Exchange, History
from blackbox.probes import load
from blackbox.server_info import ServerInfo
from blackbox.verdict import Status, merge

import histories as h

GRADING = Grading()
PROBES = ("load",)
HELD, YARDSTICK = 16, 32
PRESSURE = {"preemptions": 7.0, "evictions": 120.0}


def chain(prefix: int, arm: str, dev: float, cached: int | None) -> list[Exchange]:
    return [
        h.exchange(prefix, arm, load.TURN1, cached=0, text="a long story"),
        h.exchange(prefix, arm, load.FOLLOW, cached=cached, toks=h.tokens(-0.1 - dev, -0.2)),
        h.exchange(prefix, arm, f"{load.FOLLOW}-fresh", cached=0, toks=h.tokens(-0.1, -0.2)),
    ]


def load_history(
    treatment: Sequence[float] | None = None,
    *,
    cached: Sequence[int | None] | None = None,
    window: Mapping[str, float | None] = PRESSURE,
    reference: bool = True,
    info: ServerInfo | None = None,
) -> History:
    devs = list(treatment) if treatment is not None else [0.01 * (i % 7 + 1) for i in range(HELD)]
    hits = list(cached) if cached is not None else [h.DECODE_HIT] * HELD
    first = load.FIRST
    exchanges = [
        e for i, (d, c) in enumerate(zip(devs, hits, strict=True)) for e in chain(first + i, Arm.TREATMENT, d, c)
    ]
    if reference:
        exchanges += [
            e for i in range(YARDSTICK) for e in chain(first + i, Arm.REFERENCE, 0.01 * ((i + 3) % 7 + 1), h.DECODE_HIT)
        ]
    rows = [{"index": first + i, "prompt_tokens": h.PROMPT} for i in range(YARDSTICK)]
    data = {"held": rows[:HELD], "yardstick": rows[HELD:], "window": dict(window)}
    base = h.history([], exchanges, {Arm.TREATMENT: h.live_delta()})
    return dataclasses.replace(base, extras={load.Load.name: data}, treatment_info=info)


def verdict(history: History) -> tuple[Status, str | None]:
    found = [*gates.all_gates(history, GRADING, PROBES), *graders.grade(history, GRADING, PROBES).findings]
    v = merge(found)
    return v.status, v.error_class


def gate(history: History) -> Any:
    [finding] = load.LOAD.gates(history, GRADING)
    assert finding.check == "load-trigger"
    return finding


def test_follow_ups_under_pressure_that_resume_from_decode_written_blocks_pass_stating_what_pressed() -> None:
    history = load_history()
    assert verdict(history) == (Status.PASS, None)
    found = gate(history)
    assert "7 preemptions, 120 evicted blocks" in found.reason
    assert found.figures["decode_region_hits"] == HELD


def test_corrupt_follow_ups_under_load_fail() -> None:
    assert verdict(load_history([2.0] * HELD)) == (Status.FAIL, "CorruptionDetected")


@pytest.mark.parametrize(
    ("window", "said"),
    [
        ({"preemptions": 0.0, "evictions": 0.0}, "0 evictions"),
        ({"preemptions": 0.0, "evictions": None}, "evictions not published"),
        ({"preemptions": None, "evictions": None}, "preempted no request (not published)"),
    ],
    ids=["no-pressure", "evictions-unpublished", "nothing-published"],
)
def test_a_cache_that_held_the_whole_load_makes_the_run_unknown_and_names_the_small_cache_profile(
    window: Mapping[str, float | None], said: str
) -> None:
    history = load_history([2.0] * HELD, window=window)  # corrupt, yet not FAIL: the trigger was not shown
    found = gate(history)
    assert found.error_class == "TriggerNotExercised" and said in found.reason
    assert "cpu-tiny-load" in found.hint
    assert verdict(history) == (Status.UNKNOWN, "TriggerNotExercised")


def test_evictions_alone_are_pressure_enough() -> None:
    assert gate(load_history(window={"preemptions": 0.0, "evictions": 40.0})).status is Status.PASS


def test_follow_ups_whose_blocks_were_evicted_before_they_came_do_not_count() -> None:
    cached = [h.DECODE_HIT] * 3 + [h.PROMPT_HIT] * (HELD - 3)  # only 3 of 16 still reached the decode region
    found = gate(load_history(cached=cached))
    assert found.error_class == "TriggerNotExercised" and "only 3 of 16" in found.reason


@pytest.mark.parametrize(
    ("info", "said"),
    [
        (ServerInfo("http://t", "0.32.0+cpu", {"async_scheduling": "False"}), "async scheduling off (vLLM's CPU"),
        (ServerInfo("http://t", "0.26.0", {"async_scheduling": "True"}), "async scheduling on"),
        (None, "async scheduling not published"),
    ],
    ids=["cpu", "gpu-async", "unpublished"],
)
def test_the_trigger_says_whether_the_treatment_scheduled_asynchronously(info: ServerInfo | None, said: str) -> None:
    found = gate(load_history(info=info))
    assert said in found.reason and found.figures["scheduling"].startswith(said.split(" (")[0])


def test_without_a_reference_the_grader_has_no_evidence() -> None:
    history = load_history(reference=False)
    [finding] = graders.grade(history, GRADING, PROBES).findings
    assert finding.error_class == "NoEvidence" and "reference" in finding.reason
    assert verdict(history)[0] is Status.UNKNOWN
