"""Where a correct engine's `--detect` run is expected to stop, old schedule against new: computed, not measured.

    python bench/plan.py [--alpha 0.01] [--ratio 2]

For each `--detect` Q and `--resumes` k, the look (and conversations) at which a run of one decode-region unit a
conversation could first PASS covering Q (`sequential.expected_pass_look`: the exceedance test's critical count at
the look's level, split over the two graders' three tests, and the binomial fraction it catches with probability
0.95), under the design before 2026-12-05 (rounds of 16, alpha linear over 160) and today's (rounds of 8, 80% of
alpha by the planned look). The fixed-length run that covers Q at the whole alpha is the yardstick the issue names
(57 conversations for 20%, 122 for 10% at one resume). Measured stops are in bench/results/sequential.md.
"""

from __future__ import annotations

import argparse
import dataclasses

from blackbox import sequential


def stop(schedule: sequential.Schedule, detect: float, resumes: int) -> str:
    k = sequential.expected_pass_look(detect, resumes, schedule)
    if k is None:
        return "budget ends first"
    return f"look {k}: {schedule.looks[k - 1]} conversations at alpha {schedule.level(k):.2g}"


def fixed(detect: float, resumes: int, alpha: float, ratio: int) -> int | None:
    """The fewest conversations a fixed-length run (one look at the whole alpha) needs to promise `detect`."""
    one = sequential.Schedule(1, 4096, alpha, ratio)
    n = 1
    while n <= 4096:
        if sequential._promises(n, alpha, one, detect, resumes, sequential._AUTO_GRADERS):
            return n
        n += 1
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--ratio", type=int, default=2)
    args = parser.parse_args()
    print("| --detect | --resumes | fixed run | before: rounds of 16, linear | now: rounds of 8, planned | plan |")
    print("|---|---|---|---|---|---|")
    for detect in (0.34, 0.3, 0.2, 0.1):
        for resumes in (1, 3):
            old = sequential.Schedule(16, 160, args.alpha, args.ratio)
            base = sequential.Schedule(8, 160, args.alpha, args.ratio)
            new = dataclasses.replace(base, planned=sequential.planned_look(detect, resumes, base))
            plan = f"80% by look {new.planned}" if new.planned else "linear"
            print(
                f"| {detect:g} | {resumes} | {fixed(detect, resumes, args.alpha, args.ratio)} | "
                f"{stop(old, detect, resumes)} | {stop(new, detect, resumes)} | {plan} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
