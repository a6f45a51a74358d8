"""The short follow-up probe's requests, trigger proof and grader, on hand-built histories (blocks of 16 tokens, A's
prompt 44, A's answer 60 tokens: its whole sequence 104)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from blackbox import gates, graders
from blackbox.config import Grading, RunConfig
from blackbox.history import Arm, Exchange, History, Plan
from blackbox.probes import short_followup as short
from blackbox.store import RunStore, load_history
from blackbox.verdict import Status, merge

import histories as h

GRADING = Grading()
PROBES = ("short-follow-up",)
KINDS = short.KINDS
HELD, YARDSTICK = 8, 16
ANSWER = 60
ADDED = {"short-1": 1, "short-2": 2, "short-q": 8}  # what the CPU pair's template and tokenizer add


def chain(
    prefix: int, arm: str, devs: Sequence[float], cached: Sequence[int | None], added: dict[str, int]
) -> list[Exchange]:
    """A, its follow-ups (each hit of `cached` tokens, `devs` nats off its recomputation, `added` tokens past A's
    whole sequence) and their recomputations."""
    a = dataclasses.replace(h.exchange(prefix, arm, short.TURN1, cached=0, text="a long story"), completion_tokens=60)
    out = [a]
    for kind, dev, hit in zip(KINDS, devs, cached, strict=True):
        grown = h.PROMPT + ANSWER + added[kind]
        e = h.exchange(prefix, arm, kind, cached=hit, toks=h.tokens(-0.1 - dev, -0.2))
        again = h.exchange(prefix, arm, f"{kind}-fresh", cached=0, toks=h.tokens(-0.1, -0.2))
        out += [dataclasses.replace(e, prompt_tokens=grown), dataclasses.replace(again, prompt_tokens=grown)]
    return out


def noise(i: int) -> list[float]:
    """A correct engine's decode-region deviations: small, never twice the same."""
    return [0.01 * ((i * len(KINDS) + j) % 7 + 1) for j in range(len(KINDS))]


def short_history(
    treatment: Sequence[Sequence[float]] | None = None,
    *,
    cached: Sequence[int | None] = (h.DECODE_HIT,) * len(KINDS),
    added: dict[str, int] = ADDED,
    reference: bool = True,
) -> History:
    treatment = treatment if treatment is not None else [noise(i) for i in range(HELD)]
    first = short.FIRST
    exchanges = [e for i, devs in enumerate(treatment) for e in chain(first + i, Arm.TREATMENT, devs, cached, added)]
    if reference:
        exchanges += [e for i in range(YARDSTICK) for e in chain(first + i, Arm.REFERENCE, noise(i + 3), cached, added)]
    rows = [{"index": first + i, "prompt_tokens": h.PROMPT} for i in range(YARDSTICK)]
    data = {"held": rows[: len(treatment)], "yardstick": rows[len(treatment) :]}
    base = h.history([], exchanges, {Arm.TREATMENT: h.live_delta()})
    return dataclasses.replace(base, extras={short.ShortFollowUp.name: data})


def verdict(history: History) -> tuple[Status, str | None, dict[str, Any]]:
    found = [*gates.all_gates(history, GRADING, PROBES), *graders.grade(history, GRADING, PROBES).findings]
    v = merge(found)
    figures = next((f.figures for f in found if f.check == "short-follow-up"), {})
    return v.status, v.error_class, figures


def test_a_healthy_run_passes_stating_its_power_one_sample_a_prefix() -> None:
    status, error, figures = verdict(short_history())
    assert (status, error) == (Status.PASS, None)
    assert figures["n_subject"] == HELD and figures["n_yardstick"] == YARDSTICK
    assert (
        "would have been detected with probability 0.95"
        in merge(graders.grade(short_history(), GRADING, PROBES).findings).reason
    )


def test_only_the_one_and_two_token_follow_ups_wrong_fails() -> None:
    """short-continuation's shape: a follow-up that asks a question resumes right, a 1-2 token one does not."""
    rows = [[2.0, 2.0, n[2]] for n in (noise(i) for i in range(HELD))]
    status, error, figures = verdict(short_history(rows))
    assert (status, error) == (Status.FAIL, "CorruptionDetected")
    assert figures["n_subject"] == HELD


def test_a_single_corrupt_prefix_among_sound_ones_is_not_enough_to_fail() -> None:
    rows = [noise(i) for i in range(HELD)]
    rows[0] = [2.0] * len(KINDS)
    assert verdict(short_history(rows))[0] is Status.PASS


@pytest.mark.parametrize(
    ("cached", "added"),
    [
        ((h.PROMPT_HIT,) * len(KINDS), ADDED),  # hits end in A's prompt
        ((h.DECODE_HIT,) * len(KINDS), dict.fromkeys(KINDS, 8)),  # nothing as short as 1-2 tokens was sent
        ((None, None, h.DECODE_HIT), ADDED),  # only the question hit there
        ((None,) * len(KINDS), ADDED),  # no cached_tokens reported
    ],
    ids=["prefill-region", "no-short-follow-up", "only-the-question-hit", "unreported"],
)
def test_without_a_short_follow_up_hit_in_the_decode_region_the_run_is_unknown(
    cached: tuple[int | None, ...], added: dict[str, int]
) -> None:
    history = short_history([[2.0] * len(KINDS)] * HELD, cached=cached, added=added)
    [gate] = short.SHORT_FOLLOW_UP.gates(history, GRADING)
    assert (gate.check, gate.error_class) == ("short-trigger", "TriggerNotExercised")
    assert verdict(history)[:2] == (Status.UNKNOWN, "TriggerNotExercised")


def test_the_trigger_names_what_each_follow_up_added() -> None:
    [gate] = short.SHORT_FOLLOW_UP.gates(short_history(), GRADING)
    assert gate.status is Status.PASS
    assert gate.figures["added_tokens"][short.FIRST] == ADDED
    assert gate.figures["short_hit_prefixes"] == HELD


def test_without_a_reference_the_grader_has_no_evidence() -> None:
    history = short_history(reference=False)
    [finding] = graders.grade(history, GRADING, PROBES).findings
    assert finding.error_class == "NoEvidence" and "reference" in finding.reason
    assert verdict(history)[0] is Status.UNKNOWN


def test_follow_ups_continue_the_answer_by_one_and_two_tokens_then_ask_a_short_question() -> None:
    ctx: Any = SimpleNamespace(config=RunConfig(treatment="http://t", probes=PROBES))
    plan = Plan(1, ({"role": "user", "content": "doc"},), "q?", "code", (), 44, 100)
    a = h.exchange(1, Arm.TREATMENT, short.TURN1, text="the story")
    stages = short._stages(ctx)(plan, a)
    assert [kind for stage in stages for kind, _ in stage] == list(KINDS)  # one a stage: each resumes alone
    bodies = {kind: body for stage in stages for kind, body in stage}
    for kind, tail in (("short-1", "the story ."), ("short-2", "the story . .")):
        assert bodies[kind]["messages"][-1] == {"role": "assistant", "content": tail}
        assert bodies[kind]["continue_final_message"] is True and bodies[kind]["add_generation_prompt"] is False
    assert bodies["short-q"]["messages"][-2:] == [
        {"role": "assistant", "content": "the story"},
        {"role": "user", "content": "ok ."},
    ]
    assert "continue_final_message" not in bodies["short-q"]


def test_the_probe_record_survives_the_run_folder(tmp_path: Path) -> None:
    history = short_history()
    store = RunStore(tmp_path, "run")
    store.write_json("config.json", RunConfig(treatment="http://t", probes=PROBES).to_json())
    store.write_json("geometry.json", {"block_size": h.BLOCK})
    store.write_json("probes/short-follow-up.json", history.extras["short-follow-up"])
    for e in history.exchanges:
        store.record(e)
    store.close()
    _, loaded = load_history(tmp_path / "run")
    assert loaded.extras == history.extras
    assert len(loaded.exchanges) == len(history.exchanges)
