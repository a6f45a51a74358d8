"""Size and power of the graders' rule by simulation, for the candidate changes of issue 28 not adopted yet.

    .venv/bin/python bench/verdict_sims.py [--runs 20000] [--seed 28]

The rule is simulated through `tests/nulls.py` (the graders' FAIL rule vectorised, checked draw by draw against
`evidence.judge_samples` by tests/test_nulls.py). One pass per model prints size (a correct engine: both arms
from one law) and power (a sporadic fault: each treatment hit corrupted with probability q) for:

- rule: today's three tests at alpha/3 (Mann-Whitney with the 1.25x margin, exceedance over the 4 largest,
  Fisher on counts);
- jitter: the same with ties broken at random (every value plus a uniform jitter below the lattice step; under
  exchangeability the pooled order is then a uniformly random permutation, so the exceedance test stays exact);
- exceedance: the exceedance test alone at alpha (one pre-registered statistic);
- exceedance+fisher: those two at alpha/2 (the shift test dropped).

Models: a bf16-like lattice (deviations 0, 1 or 2 steps of 0.0625 nat with probabilities 0.4, 0.5, 0.1; a fault
adds 2 steps) and a continuous one (half-normal, scale 0.01 nat; a fault adds 0.05 nat), 32 and 64 treatment
hits against a reference 1x and 2x as large, alpha 0.01 (one grader alone).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the vectorised rule lives with its test
import nulls

ALPHA = 0.01
STEP = 0.0625


def lattice(rng: np.random.Generator, shape: tuple[int, int]) -> nulls.Draws:
    return STEP * rng.choice([0.0, 1.0, 2.0], p=[0.4, 0.5, 0.1], size=shape) + 1e-9  # > 0: noise mode


def continuous(rng: np.random.Generator, shape: tuple[int, int]) -> nulls.Draws:
    return np.abs(rng.normal(0.0, 0.01, size=shape)) + 1e-9


MODELS = {"lattice": (lattice, 2 * STEP), "continuous": (continuous, 0.05)}


def rules(x: nulls.Draws, y: nulls.Draws, rng: np.random.Generator) -> dict[str, float]:
    jitter = STEP / 100
    xj, yj = x + jitter * rng.random(x.shape), y + jitter * rng.random(y.shape)
    return {
        "rule": float(nulls.fails(x, y, ALPHA).mean()),
        "jitter": float(nulls.fails(xj, yj, ALPHA).mean()),
        "exceedance": float(nulls.exceeds(x, y, ALPHA).mean()),
        "exceedance jitter": float(nulls.exceeds(xj, yj, ALPHA).mean()),
        "exceedance+fisher": float((nulls.exceeds(x, y, ALPHA / 2) | nulls.count(x, y, ALPHA / 2)).mean()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=28)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print("| model | hits | reference | q | " + " | ".join(rules(np.ones((2, 12)), np.ones((2, 12)), rng)) + " |")
    for name, (draw, fault) in MODELS.items():
        for n in (32, 64):
            for ratio in (1, 2):
                y = draw(rng, (args.runs, n * ratio))
                for q in (0.0, 0.1, 0.2):
                    x = draw(rng, (args.runs, n))
                    x = np.where(rng.random(x.shape) < q, x + fault, x)
                    figures = rules(x, y, rng)
                    cells = " | ".join(f"{v:.4f}" for v in figures.values())
                    print(f"| {name} | {n} | {n * ratio} | {q} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
