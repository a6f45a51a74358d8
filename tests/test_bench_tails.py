"""bench/tails.py's exceedance beyond the reference's k-th largest: k = 1 is the single-threshold test, and the
negative hypergeometric null matches a permutation of exchangeable deviations."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from blackbox import stats

from engine_env import bench_module

tails = bench_module("tails")


def test_k1_is_the_single_threshold_exceedance_test() -> None:
    rng = random.Random(0)
    for _ in range(200):
        x = [rng.random() for _ in range(rng.randint(1, 40))]
        y = [rng.random() for _ in range(rng.randint(1, 80))]
        m, p = tails.beyond_kth(x, y, 1)
        shipped = stats.exceedance(x, y)
        assert m == shipped.statistic
        assert math.isclose(p, shipped.p_value, rel_tol=1e-9)


def test_the_null_of_the_kth_threshold_matches_a_permutation() -> None:
    rng = random.Random(1)
    draws, at_least = 6000, 0
    for _ in range(draws):
        pooled = [rng.random() for _ in range(60)]
        m, _ = tails.beyond_kth(pooled[:20], pooled[20:], 3)
        at_least += m >= 5
    _, exact = tails.beyond_kth([2.0] * 5 + [0.0] * 15, [1.0] * 3 + [0.5] * 37, 3)  # exactly 5 beyond the 3rd
    assert abs(at_least / draws - exact) < 0.012  # 3.5% expected; 4 binomial standard deviations


def test_nothing_beyond_reads_p_1_and_too_few_reference_values_read_nothing() -> None:
    assert tails.beyond_kth([0.1, 0.2], [0.5, 0.4, 0.3], 2) == (0, 1.0)
    assert tails.beyond_kth([0.1], [0.5], 2) is None
    assert tails.group("/runs/bench/clean-s12-n32-r2") == "clean-n32-r2"
    assert tails.group("sittings/gpu4/eagle-a-s104") == "eagle-a"


def test_pairing_ranks_a_conversations_treatment_deviation_against_its_reference_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from blackbox.evidence import Sample
    from blackbox.history import Arm

    arms = {
        Arm.TREATMENT: {0: 0.1, 1: 0.2, 2: 0.3, 3: math.inf, 4: 0.5},  # the flip and the unmatched 4 drop out
        Arm.REFERENCE: {0: 0.01, 1: 0.02, 2: 0.03, 3: 0.04, 5: 0.06, 6: 0.07},
    }
    from servers.gpu import digest  # where the per-arm deviations are read

    monkeypatch.setattr(digest, "compared_positions", lambda history, grading: 4)
    monkeypatch.setattr(
        digest, "samples", lambda history, arm, *rest: [Sample(u, "turn2", d, True) for u, d in arms[arm].items()]
    )
    again = SimpleNamespace(history=None, config=SimpleNamespace(grading=SimpleNamespace(hard_margin=1.0)))
    row = tails.pairing(again)
    assert (row["paired"], row["spearman"]) == (3, pytest.approx(1.0))
    arms[Arm.REFERENCE] = {0: 0.03, 1: 0.02, 2: 0.01}
    assert tails.pairing(again)["spearman"] == pytest.approx(-1.0)
    arms[Arm.REFERENCE] = {0: 0.03, 1: 0.02}
    assert tails.pairing(again) == {"paired": 2, "spearman": None, "spearman_p": None}
