"""Simulations of the graders' rule: under the null (a correct engine) it must FAIL at most alpha of the time, and
a stated power must be what the rule delivers. Vectorised (`nulls`), 20 000 runs each, seeded."""

from __future__ import annotations

import math

import numpy as np
import pytest

from blackbox import evidence, stats
from blackbox.evidence import Sample

import nulls

ALPHA = 0.01  # one grader alone; each of its three tests at a third
RUNS = 20_000
SLACK = 3 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS)


def test_the_vectorised_rule_decides_as_judge_samples() -> None:
    # On a bf16-like lattice with ties, some confident flips and, in half the runs, a shifted subset.
    rng = np.random.default_rng(0)
    x = 0.0625 * rng.integers(1, 6, size=(120, 16)).astype(float)
    y = 0.0625 * rng.integers(1, 6, size=(120, 12)).astype(float)
    x[60:, :10] += rng.choice([0.3, 0.5, math.inf], size=(60, 10))
    x[rng.random(x.shape) < 0.03] = math.inf
    y[rng.random(y.shape) < 0.03] = math.inf
    vectorised = nulls.fails(x, y, ALPHA)
    one_by_one = [
        evidence.judge_samples(
            "sim",
            [Sample(i, "x", float(v), True) for i, v in enumerate(xs)],
            [Sample(i, "y", float(v), True) for i, v in enumerate(ys)],
            alpha=ALPHA,
            what="hits",
            against="the reference's",
            runs=16,
            hint="",
        ).error_class
        == "CorruptionDetected"
        for xs, ys in zip(x, y, strict=True)
    ]
    assert vectorised.tolist() == one_by_one
    assert 10 < sum(one_by_one) < 110  # both outcomes occur


def _half_normal(rng: np.random.Generator, scale: float, *shape: int) -> nulls.Draws:
    return np.abs(rng.normal(0.0, scale, size=(RUNS, *shape)))


@pytest.mark.parametrize("conversations", [32, 64])
def test_stratified_exactness_holds_its_level_where_pooling_does_not(conversations: int) -> None:
    # A correct engine: probes deviate alike on both arms; the treatment's turn-2 hits that stopped in the prompt
    # region (half its conversations; the reference has none) resumed from a longer prompt and deviate three times
    # as much. Pooled against the reference's probes they read as corruption far more often than alpha (measured:
    # 3.7% at 32 conversations, 27% at 64; stratified 0.03% and 0%). (Twice as much, the case this test had before
    # the exceedance thresholds took the 1.25x margin: 0.58% and 1.6% pooled, 5.9% and 21% without the margin.)
    rng = np.random.default_rng(28)
    probe_t, probe_r = _half_normal(rng, 0.01, conversations), _half_normal(rng, 0.01, conversations)
    turn2_t = _half_normal(rng, 0.03, conversations // 2)
    pooled = nulls.fails(np.concatenate([probe_t, turn2_t], axis=1), probe_r, ALPHA).mean()
    stratified = nulls.fails(probe_t, probe_r, ALPHA).mean()  # the one stratum with a yardstick, at all of alpha
    assert stratified <= ALPHA
    assert pooled > 3 * ALPHA
    # where the reference has such turn-2 hits too, both strata are graded at alpha / 2 each
    turn2_r = _half_normal(rng, 0.03, conversations // 2)
    both = nulls.fails(probe_t, probe_r, ALPHA / 2) | nulls.fails(turn2_t, turn2_r, ALPHA / 2)
    assert both.mean() <= ALPHA


@pytest.mark.parametrize("rounds", [12, 18])
def test_one_racer_draw_per_round_holds_the_race_level_where_every_racer_does_not(rounds: int) -> None:
    # The racers of a round are computed alike (one batch, one chunking) up to a little scheduling noise, and each
    # deviates from the round's one recomputation, so a recomputation that lands off puts them all high together.
    # Each follow-up has its own cold-like computation and its own recomputation: the same marginal law, a correct
    # engine. Measured: every racer a draw 5.8% (12 rounds) and 4.3% (18); one draw a round 0.06% and 0.04%
    # (before the exceedance thresholds took the 1.25x margin: 19% and 0.32%).
    rng = np.random.default_rng(45477)
    racers, followups = 8, 4
    batch, recomputation = rng.normal(size=(RUNS, rounds, 1)), rng.normal(size=(RUNS, rounds, 1))
    cold = np.abs(batch + 0.1 * rng.normal(size=(RUNS, rounds, racers)) - recomputation)
    shape = (RUNS, rounds * followups)
    follow = np.abs(rng.normal(size=shape) + 0.1 * rng.normal(size=shape) - rng.normal(size=shape))
    every = nulls.fails(follow, cold.reshape(RUNS, -1), ALPHA).mean()
    one = nulls.fails(follow, cold[:, :, 0], ALPHA).mean()
    assert one <= ALPHA
    assert every > 3 * ALPHA


def test_the_stated_run_length_is_for_corruption_beyond_all_of_that_runs_yardstick() -> None:
    # A 32-conversation PASS (32 hits against 32) says "20% would need about N". At N the reference is larger and
    # reaches further: corruption beyond all of it is caught with the stated power, corruption just beyond this
    # run's largest with the lower probability the PASS now states with it (`stats.power_just_beyond`).
    level = ALPHA / 3
    need = stats.conversations_needed(32, 32, level, 0.2, evidence.POWER, 1.0, evidence.RANKS)
    assert need is not None
    rng = np.random.default_rng(20)
    corrupt = rng.random((RUNS, need)) < 0.2
    beyond_all = np.where(corrupt, 2.0, rng.random((RUNS, need)))
    caught = nulls.exceeds(beyond_all, rng.random((RUNS, need)), level, evidence.RANKS).mean()
    assert caught >= evidence.POWER - 3 * math.sqrt(evidence.POWER * (1 - evidence.POWER) / RUNS)
    largest = rng.random((RUNS, 32)).max(axis=1, keepdims=True)
    just_beyond = np.where(corrupt, evidence.MARGIN * largest + 1e-12, rng.random((RUNS, need)))
    caught_just = nulls.exceeds(just_beyond, rng.random((RUNS, need)), level, evidence.RANKS).mean()
    stated = stats.power_just_beyond(need, need, 32, level, 0.2, evidence.RANKS)
    # the statement leaves out clean hits that happen to lie beyond the threshold too: a lower bound
    assert stated <= caught_just + 3 * math.sqrt(stated * (1 - stated) / RUNS)
    assert caught_just < 0.9 < caught


@pytest.mark.parametrize("resumes", [1, 3])
def test_a_correct_treatment_a_little_noisier_than_its_reference_does_not_read_fail(resumes: int) -> None:
    # A correct engine that is not bit-exact alike on both arms: the treatment resumes from states written during
    # speculative decoding, under another chunking or reduction order, and deviates 1.1x as much as the reference
    # everywhere (per conversation: the largest of `resumes` hits). At 64 conversations, reference 2x. Measured:
    # with the exceedance thresholds at the yardstick's values themselves (margin 1) 3.8% FAIL at one resume and
    # 10% at maxima of 3; at the graders' 1.25x, 0.005% and 0%.
    rng = np.random.default_rng(11)
    x = 1.1 * _half_normal(rng, 0.01, 64, resumes).max(axis=2)
    y = _half_normal(rng, 0.01, 128, resumes).max(axis=2)
    assert nulls.fails(x, y, ALPHA).mean() <= ALPHA
    assert nulls.fails(x, y, ALPHA, margin=1.0).mean() > 3 * ALPHA
