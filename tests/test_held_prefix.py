"""The held-prefix probe's trigger proof and grader, on hand-built histories (blocks of 16 tokens, A's prompt 44)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from blackbox import gates, graders
from blackbox.config import Grading, RunConfig
from blackbox.history import Arm, Exchange, History
from blackbox.probes import held_prefix as held
from blackbox.store import RunStore, load_history
from blackbox.verdict import Status, merge

import histories as h

GRADING = Grading()
PROBES = ("held-prefix",)
KINDS = held.resume_kinds()
HELD, YARDSTICK = 8, 16


def chain(prefix: int, arm: str, devs: Sequence[float], cached: Sequence[int | None]) -> list[Exchange]:
    """A, its resumes (each hit of `cached` tokens, `devs` nats off its recomputation) and their recomputations."""
    out = [h.exchange(prefix, arm, held.TURN1, cached=0, text="a long story")]
    for kind, dev, hit in zip(KINDS, devs, cached, strict=True):
        out.append(h.exchange(prefix, arm, kind, cached=hit, toks=h.tokens(-0.1 - dev, -0.2)))
        out.append(h.exchange(prefix, arm, f"{kind}-fresh", cached=0, toks=h.tokens(-0.1, -0.2)))
    return out


def noise(i: int) -> list[float]:
    """A correct engine's decode-region deviations: small, never twice the same."""
    return [0.01 * ((i * len(KINDS) + j) % 7 + 1) for j in range(len(KINDS))]


def held_history(
    treatment: Sequence[Sequence[float]] | None = None,
    *,
    cached: Sequence[int | None] = (h.DECODE_HIT,) * len(KINDS),
    reference: bool = True,
) -> History:
    treatment = treatment if treatment is not None else [noise(i) for i in range(HELD)]
    first = held.FIRST
    exchanges = [e for i, devs in enumerate(treatment) for e in chain(first + i, Arm.TREATMENT, devs, cached)]
    if reference:
        exchanges += [e for i in range(YARDSTICK) for e in chain(first + i, Arm.REFERENCE, noise(i + 3), cached)]
    rows = [{"index": first + i, "prompt_tokens": h.PROMPT} for i in range(YARDSTICK)]
    data = {"held": rows[: len(treatment)], "yardstick": rows[len(treatment) :], "resumes": held.RESUMES}
    base = h.history([], exchanges, {Arm.TREATMENT: h.live_delta()})
    return dataclasses.replace(base, extras={held.HeldPrefix.name: data})


def poisoned() -> list[list[float]]:
    return [[2.0] * len(KINDS) for _ in range(HELD)]


def transient() -> list[list[float]]:
    """B1 and A's own follow-up exact, B2..Bn wrong: only the requests that resumed together."""
    return [[n[0], *[2.0] * (len(KINDS) - 2), n[-1]] for n in (noise(i) for i in range(HELD))]


def verdict(history: History) -> tuple[Status, str | None, dict[str, object]]:
    found = [*gates.all_gates(history, GRADING, PROBES), *graders.grade(history, GRADING, PROBES).findings]
    v = merge(found)
    figures = next((f.figures for f in found if f.check == "held-prefix"), {})
    return v.status, v.error_class, figures


def test_a_healthy_held_prefix_run_passes_stating_its_power() -> None:
    status, error, figures = verdict(held_history())
    assert (status, error) == (Status.PASS, None)
    assert figures["n_subject"] == HELD and figures["n_yardstick"] == YARDSTICK  # one sample per re-hit block
    assert figures["seen"] is None


@pytest.mark.parametrize(("treatment", "seen"), [(poisoned, "poisoned"), (transient, "transient")])
def test_corrupt_resumes_fail_and_the_finding_says_poisoned_or_transient(
    treatment: Callable[[], list[list[float]]], seen: str
) -> None:
    history = held_history(treatment())
    status, error, figures = verdict(history)
    assert (status, error) == (Status.FAIL, "CorruptionDetected")
    assert figures["seen"] == seen
    [finding] = graders.grade(history, GRADING, PROBES).findings
    assert ("a poisoned block" in finding.reason) is (seen == "poisoned")
    assert ("a transient fault" in finding.reason) is (seen == "transient")
    bad = f"{len(KINDS)}/{len(KINDS)}" if seen == "poisoned" else f"{len(KINDS) - 2}/{len(KINDS)}"
    assert set(figures["deviating_resumes"].values()) == {bad}  # type: ignore[attr-defined]


def test_a_single_corrupt_block_among_sound_ones_is_not_enough_to_fail() -> None:
    rows = [noise(i) for i in range(HELD)]
    rows[0] = [2.0] * len(KINDS)
    assert verdict(held_history(rows))[0] is Status.PASS


@pytest.mark.parametrize(
    ("cached", "error"),
    [
        ((h.PROMPT_HIT,) * len(KINDS), "TriggerNotExercised"),  # hits end in A's prompt
        ((h.DECODE_HIT, None, None, None), "TriggerNotExercised"),  # one resume reached it: no re-hit
        ((None,) * len(KINDS), "TriggerNotExercised"),  # no cached_tokens reported
    ],
    ids=["prefill-region", "hit-once", "unreported"],
)
def test_resumes_that_do_not_re_hit_a_decode_written_block_make_the_run_unknown(
    cached: tuple[int | None, ...], error: str
) -> None:
    history = held_history(poisoned(), cached=cached)
    [gate] = held.HELD_PREFIX.gates(history, GRADING)
    assert (gate.check, gate.error_class) == ("held-trigger", error)
    assert verdict(history)[:2] == (Status.UNKNOWN, error)


def test_without_a_reference_the_grader_has_no_evidence() -> None:
    history = held_history(poisoned(), reference=False)
    [finding] = graders.grade(history, GRADING, PROBES).findings
    assert finding.error_class == "NoEvidence" and "reference" in finding.reason
    assert verdict(history)[0] is Status.UNKNOWN


def test_the_probe_record_survives_the_run_folder(tmp_path: Path) -> None:
    history = held_history(transient())
    store = RunStore(tmp_path, "run")
    store.write_json("config.json", RunConfig(treatment="http://t", probes=PROBES).to_json())
    store.write_json("geometry.json", {"block_size": h.BLOCK})
    store.write_json("probes/held-prefix.json", history.extras["held-prefix"])
    for e in history.exchanges:
        store.record(e)
    store.close()
    _, loaded = load_history(tmp_path / "run")
    assert loaded.extras == history.extras  # what the grader reads besides the exchanges
    assert len(loaded.exchanges) == len(history.exchanges)


def timed(history: History, starts: Sequence[float], elapsed: float = 1.0) -> History:
    """Each treatment resume of every prefix sent at `starts[j]` (its kind's place in KINDS), taking `elapsed`."""
    at = dict(zip(KINDS, starts, strict=True))

    def when(e: Exchange) -> Exchange:
        start = at.get(e.kind, 100.0) if e.arm == Arm.TREATMENT else 100.0
        return dataclasses.replace(e, started_s=start, elapsed_s=elapsed)

    return dataclasses.replace(history, exchanges=tuple(when(e) for e in history.exchanges))


def test_the_trigger_says_how_many_blocks_resumes_in_flight_together_re_hit() -> None:
    # B1..Bn sent together, A's own follow-up after them: every block was re-hit by resumes in flight at once.
    together = timed(held_history(), [0.0] * (len(KINDS) - 1) + [5.0])
    [gate] = held.HELD_PREFIX.gates(together, GRADING)
    assert gate.status is Status.PASS and gate.figures["re_hit_together"] == HELD
    assert f"{HELD} of {HELD} blocks by two or more resumes in flight at once" in gate.reason


def test_resumes_one_after_another_still_pass_the_trigger_and_say_none_were_together() -> None:
    """Not a gate: a poisoned block shows on resumes one at a time too; only the concurrent family needs overlap."""
    apart = timed(held_history(), [float(2 * j) for j in range(len(KINDS))])
    [gate] = held.HELD_PREFIX.gates(apart, GRADING)
    assert gate.status is Status.PASS and gate.figures["re_hit_together"] == 0
    assert f"0 of {HELD} blocks by two or more resumes in flight at once" in gate.reason


def test_a_run_without_a_timeline_says_nothing_about_overlap() -> None:
    [gate] = held.HELD_PREFIX.gates(held_history(), GRADING)  # hand-built exchanges carry no start times
    assert gate.status is Status.PASS and gate.figures["re_hit_together"] is None
    assert "in flight at once" not in gate.reason


@pytest.mark.parametrize(
    ("spans", "together"),
    [
        ([(0.0, 1.0), (0.5, 1.0)], True),
        ([(0.0, 5.0), (1.0, 1.0), (3.0, 1.0)], True),  # the first overlaps both later ones
        ([(0.0, 1.0), (1.0, 1.0), (2.5, 1.0)], False),  # one ends as the next starts: not at once
        ([(0.0, 1.0)], False),
        ([(0.0, 1.0), (None, 1.0)], None),
    ],
)
def test_in_flight_together_reads_the_clients_start_and_elapsed_times(
    spans: list[tuple[float | None, float]], together: bool | None
) -> None:
    exchanges = [
        dataclasses.replace(h.exchange(1, Arm.TREATMENT, f"k{i}"), started_s=start, elapsed_s=took)
        for i, (start, took) in enumerate(spans)
    ]
    assert held.in_flight_together(exchanges) is together
