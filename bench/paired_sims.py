"""Paired statistics and several resumes per conversation against today's two-sample rule, by simulation (issue 24).

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/paired_sims.py [--runs 20000] [--seed 24] [--models ...]

(from the repository root; results of 2026-12-04 in bench/results/paired.md). Each conversation's treatment and
reference share a seed and a plan. Today the logprob grader compares two independent samples: the treatment's N
decode-region deviations against the reference's 2N (`--reference-ratio` 2: the same N plans and N more). One row
a (model, scheme, N, q); a sporadic fault adds a fixed amount to each treatment hit with probability q; size is the
q = 0 row, power the others, alpha 0.01 (one grader alone), one hit (resume) a conversation unless the scheme says.

Statistics (columns):

- two-sample: today's rule, the three tests at alpha/3 through `tests/nulls.py` (checked draw by draw against
  `evidence.judge_samples` by tests/test_nulls.py), treatment N against the reference's 2N;
- sign: exact one-sided sign test (binomial, zeros dropped) on the per-plan difference d = x - y over the N plans
  both arms ran. Exact for any law under which the two arms of a plan are exchangeable, whatever the plan's own
  scale; it ignores magnitudes. The reference's N extra plans have no partner and are not used;
- wilcoxon: Wilcoxon signed-rank (scipy.stats.wilcoxon, one-sided, zeros dropped, normal approximation with
  scipy's tie correction) on the same d: uses magnitudes, valid where d is symmetric (arms exchangeable per plan);
- wilcoxon 1.25: the same on d = x - 1.25 y, the shift test's margin. Valid (conservative) whenever the treatment
  is the reference up to a scale c <= 1.25 per plan: d = c y' - 1.25 y <= c (y' - y), which is symmetric, and the
  signed-rank statistic (a count of positive Walsh averages) is monotone in every d;
- two-sample unscaled: the rule before 2026-12-04, its exceedance thresholds at the yardstick's values themselves
  (bench/results/paired.md, made then, calls the graders' present rule "two-sample 1.25" and this one "two-sample");
- paired tail: the paired analogue of the exceedance test: the signs of the 12 largest |d| (ties by plan order,
  zeros dropped); the smallest binomial p over the top k = 1..12, calibrated exactly over the 2^12 sign patterns.
  Exact under arm exchangeability per plan (signs are then fair coins given the |d|);
- paired tail 1.25: the same on d = x - 1.25 y (no proof of validity: its statistic is not monotone in d; measured);
- two-sample + wilcoxon 1.25, two-sample + paired tail 1.25: today's rule at alpha/2 (its three tests at alpha/6)
  or the paired test at alpha/2 (Bonferroni), the combinations one would adopt to keep today's power.

Schemes (rows): "1 resume" (today); "max of r, independent": r = 2 or 3 decode-written boundaries a conversation,
each corrupted with probability q on its own, the conversation scored by its largest deviation on both arms (the
reference's extra plans too), then every statistic on those maxima; "max of 3, correlated": the same, but a
conversation's resumes are corrupted together (one poisoned block under all of them: the worst case).

Noise models (deviation of one hit from its recomputation on the same server):

- continuous: half-normal, scale 0.01 nat, alike on both arms; a fault adds 0.05 nat;
- lattice: bf16-like, 0, 1 or 2 steps of 0.0625 nat with probabilities 0.4, 0.5, 0.1 (`bench/verdict_sims.py`),
  ties everywhere; a fault adds 2 steps;
- hetero: per-plan scale 0.01 exp(0.75 G), G standard normal, shared by the treatment and the reference of a plan
  (and by a conversation's resumes), half-normal given the scale; a fault adds 0.05 nat;
- hetero lattice: the same on the lattice: round(s |Z|) steps with a per-plan s = 0.95 exp(0.5 G) (about 0.4, 0.5,
  0.1 again on average); a fault adds 2 steps;
- benign x1.1 (continuous, hetero, hetero lattice): the treatment's noise 1.1x the reference's everywhere (a
  correct engine computing a little differently, e.g. chunked prefill), no fault: every FAIL is a false alarm.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from scipy import stats as sp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the vectorised rule lives with its test
import nulls

ALPHA = 0.01
STEP = 0.0625
RATIO = 2  # --reference-ratio
TAIL = 12  # the paired tail test's deepest rank
SIZES = (16, 24, 32, 64)
FRACTIONS = (0.0, 0.1, 0.2)
Array = NDArray[np.float64]
# One model: (rng, per-plan normal G (runs, plans), shape (runs, plans, resumes), the arm's scale) -> deviations.
# The plan's law is shared by both arms through G: the treatment's N plans are the reference's first N.
Noise = Callable[[np.random.Generator, Array, tuple[int, int, int], float], Array]


def continuous(rng: np.random.Generator, g: Array, shape: tuple[int, int, int], c: float) -> Array:
    return c * np.abs(rng.normal(0.0, 0.01, size=shape)) + 1e-9  # > 0: noise mode


def lattice(rng: np.random.Generator, g: Array, shape: tuple[int, int, int], c: float) -> Array:
    assert c == 1.0, "the plain lattice has no scale"
    return STEP * rng.choice([0.0, 1.0, 2.0], p=[0.4, 0.5, 0.1], size=shape) + 1e-9


def hetero(rng: np.random.Generator, g: Array, shape: tuple[int, int, int], c: float) -> Array:
    return c * 0.01 * np.exp(0.75 * g)[:, :, None] * np.abs(rng.normal(size=shape)) + 1e-9


def hetero_lattice(rng: np.random.Generator, g: Array, shape: tuple[int, int, int], c: float) -> Array:
    return STEP * np.round(c * 0.95 * np.exp(0.5 * g)[:, :, None] * np.abs(rng.normal(size=shape))) + 1e-9


# name: (noise, fault added to a corrupted hit, the treatment's benign scale)
MODELS: dict[str, tuple[Noise, float, float]] = {
    "continuous": (continuous, 0.05, 1.0),
    "lattice": (lattice, 2 * STEP, 1.0),
    "hetero": (hetero, 0.05, 1.0),
    "hetero lattice": (hetero_lattice, 2 * STEP, 1.0),
    "benign x1.1 continuous": (continuous, 0.05, 1.1),
    "benign x1.1 hetero": (hetero, 0.05, 1.1),
    "benign x1.1 hetero lattice": (hetero_lattice, 2 * STEP, 1.1),
}
# name: (resumes a conversation, corruption drawn per resume (False: per conversation))
SCHEMES = {
    "1 resume": (1, True),
    "max of 2, independent": (2, True),
    "max of 3, independent": (3, True),
    "max of 3, correlated": (3, False),
}
STATISTICS = (
    "two-sample",
    "two-sample unscaled",
    "sign",
    "wilcoxon",
    "wilcoxon 1.25",
    "paired tail",
    "paired tail 1.25",
    "two-sample + wilcoxon 1.25",
    "two-sample + paired tail 1.25",
)


def _tail_null(k: int) -> Array:
    """The smallest binomial p over the top 1..k signs, for each of the 2^k equally likely sign patterns."""
    patterns = np.array(list(itertools.product([0, 1], repeat=k)), dtype=float)
    return np.sort(_tail_min_p(patterns))


def _tail_min_p(signs: Array) -> Array:
    k = signs.shape[1]
    positive = np.cumsum(signs, axis=1)
    depth = np.arange(1, k + 1)
    return sp.binom.sf(positive - 1, depth, 0.5).min(axis=1)


NULLS = {k: _tail_null(k) for k in range(1, TAIL + 1)}


def paired_tail(d: Array) -> Array:
    """p-values of the paired tail test, one a run."""
    order = np.argsort(-np.abs(d), axis=1, kind="stable")
    ranked = np.take_along_axis(d, order, axis=1)
    nonzero = (d != 0).sum(axis=1)
    p = np.ones(d.shape[0])
    for k in range(1, TAIL + 1):
        rows = np.minimum(nonzero, TAIL) == k
        if rows.any():
            observed = _tail_min_p((ranked[rows, :k] > 0).astype(float))
            # P(min p <= observed) under the null: the share of the 2^k patterns at least as extreme.
            p[rows] = np.searchsorted(NULLS[k], observed * (1 + 1e-9), side="right") / 2**k
    return p


def sign(d: Array) -> Array:
    return sp.binom.sf((d > 0).sum(axis=1) - 1, (d != 0).sum(axis=1), 0.5)


def wilcoxon(d: Array) -> Array:
    with np.errstate(invalid="ignore", divide="ignore"):
        p = sp.wilcoxon(d, axis=1, alternative="greater", zero_method="wilcox", method="asymptotic").pvalue
    return np.nan_to_num(np.asarray(p), nan=1.0)


def two_sample_unscaled(x: Array, y: Array) -> NDArray[np.bool_]:
    """The rule before 2026-12-04: the exceedance test's thresholds at the yardstick's values themselves (the
    graders' rule, `nulls.fails`, puts them at 1.25x, as the shift test's)."""
    level = ALPHA / 3
    shift = sp.mannwhitneyu(x, 1.25 * y, axis=1, alternative="greater", method="asymptotic").pvalue < level
    return np.asarray(shift) | nulls.exceeds(x, y, level, margin=1.0) | nulls.count(x, y, level)


def statistics(x: Array, y: Array) -> dict[str, float]:
    """FAIL rates over the runs. x: (runs, N) treatment scores; y: (runs, RATIO N), its first N on x's plans."""
    n = x.shape[1]
    paired = y[:, :n]
    d = np.round(x - paired, 12)  # equal lattice values give an exact zero
    margin = np.round(x - 1.25 * paired, 12)
    half = nulls.fails(x, y, ALPHA / 2)
    return {
        "two-sample": float(nulls.fails(x, y, ALPHA).mean()),
        "two-sample unscaled": float(two_sample_unscaled(x, y).mean()),
        "sign": float((sign(d) < ALPHA).mean()),
        "wilcoxon": float((wilcoxon(d) < ALPHA).mean()),
        "wilcoxon 1.25": float((wilcoxon(margin) < ALPHA).mean()),
        "paired tail": float((paired_tail(d) < ALPHA).mean()),
        "paired tail 1.25": float((paired_tail(margin) < ALPHA).mean()),
        "two-sample + wilcoxon 1.25": float((half | (wilcoxon(margin) < ALPHA / 2)).mean()),
        "two-sample + paired tail 1.25": float((half | (paired_tail(margin) < ALPHA / 2)).mean()),
    }


def simulate(model: str, scheme: str, n: int, q: float, runs: int, rng: np.random.Generator) -> dict[str, float]:
    noise, fault, benign = MODELS[model]
    resumes, per_resume = SCHEMES[scheme]
    g = rng.normal(size=(runs, RATIO * n))  # the plans' own noisiness, shared by both arms
    x = noise(rng, g[:, :n], (runs, n, resumes), benign)
    y = noise(rng, g, (runs, RATIO * n, resumes), 1.0)
    corrupt = rng.random(x.shape if per_resume else (runs, n, 1)) < q  # per conversation: one draw for its resumes
    x = np.where(corrupt, x + fault, x)
    return statistics(x.max(axis=2), y.max(axis=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--sizes", nargs="*", type=int, default=list(SIZES))
    args = parser.parse_args(argv)
    print(f"| model | scheme | N | q | {' | '.join(STATISTICS)} |")
    print("|---|---|---|---|" + "---|" * len(STATISTICS))
    for model in args.models:
        rng = np.random.default_rng([args.seed, list(MODELS).index(model)])
        fractions = (0.0,) if MODELS[model][2] != 1.0 else FRACTIONS  # a benign difference: size only
        for scheme, n, q in itertools.product(args.schemes, args.sizes, fractions):
            figures = simulate(model, scheme, n, q, args.runs, rng)
            cells = " | ".join(f"{figures[s]:.4f}" for s in STATISTICS)
            print(f"| {model} | {scheme} | {n} | {q} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
