"""How the logprob grader's exceedance test would read kept runs if its threshold sat deeper in the reference's tail.

    .venv/bin/python bench/tails.py RUN_DIR... [--k 1,2,3,4] [--level 0.00167] [--out tails.jsonl]

The exceedance test before the fifth GPU sitting counted treatment decode-region deviations beyond the reference's
*largest* and asked how likely that many are under exchangeability. One outlier among the reference's deviations
raises that threshold for the whole run: on the H200 a 0.2 sporadic fault went unseen because the reference's
largest was 0.432 nat where its next was 0.365 and other runs' largest 0.19-0.24 (bench/results/gpu.md, fourth
sitting). This script measures single deeper thresholds on stored traffic, without changing the verdict: for each
run (re-judged with this checkout's code, `engine.rejudge`), the count m of treatment deviations beyond the
reference's k-th largest and its exact p-value. Drawing the pooled deviations from the top without replacement, the
treatment values seen before the k-th reference value follow a negative hypergeometric law
(`scipy.stats.nhypergeom(N, n_treatment, k)`); k = 1 is C(n_t, m) / C(n_t + n_r, m). The rule since takes the best
of k = 1..4 at its exact level (`stats.exceedance(..., ranks=4)`); this script reports each k alone. Confident
token flips (infinite deviations) are left out, as the count test (Fisher) judges those. One JSON line per run,
then a summary per run group: the smallest p over the group for each k (clean groups: how close a false alarm
came) and how many runs fell below --level.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scipy.stats import spearmanr

from blackbox.engine import Rejudged, rejudge
from blackbox.history import Arm
from servers.gpu.digest import beyond_kth, deviations, run_dir, thresholds

__all__ = ["beyond_kth", "group", "main", "measure", "pairing"]


def measure(path: Path, ks: Sequence[int]) -> dict[str, Any]:
    again = rejudge(run_dir(path))
    return {"run": str(path), "status": again.verdict.status.value, **thresholds(again, ks), **pairing(again)}


def pairing(again: Rejudged) -> dict[str, Any]:
    """Whether a conversation's treatment deviation follows its reference deviation (the same seeded conversation
    on both): Spearman's rank correlation over the conversations both arms judged with finite deviations. Were it
    strong, a paired test would beat the two-sample ones; measured, it is not (bench/results/gpu.md)."""
    t, r = deviations(again, Arm.TREATMENT), deviations(again, Arm.REFERENCE)
    common = sorted(set(t) & set(r))
    if len(common) < 3:
        return {"paired": len(common), "spearman": None, "spearman_p": None}
    rho = spearmanr([t[u] for u in common], [r[u] for u in common])
    return {"paired": len(common), "spearman": float(rho.statistic), "spearman_p": float(rho.pvalue)}


def group(run: str) -> str:
    """A run folder's case: its name without the seed (bench: case-sN-nL[-rX]; GPU sittings: name-sN)."""
    return re.sub(r"-s\d+", "", Path(run).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/tails.py", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--k", default="1,2,3,4", help="reference ranks to put the threshold at")
    parser.add_argument("--level", type=float, default=0.005 / 3, help="the per-test level to count p below")
    parser.add_argument("--out", type=Path, help="also append the per-run lines here")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.k.split(",")]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in args.runs:
        try:
            row = measure(path, ks)
        except Exception as exc:  # a cut or foreign folder: say so and go on with the rest
            print(json.dumps({"run": str(path), "error": repr(exc)[:200]}), flush=True)
            continue
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")
        groups[group(row["run"])].append(row)
    print(
        f"\n| group | runs | verdicts | smallest p, k = {', '.join(map(str, ks))} | below {args.level:.3g} "
        "| treatment-reference Spearman (paired conversations) |"
    )
    print("|---|---|---|---|---|---|")
    for name, rows in sorted(groups.items()):
        verdicts = ", ".join(f"{s} {sum(r['status'] == s for r in rows)}" for s in sorted({r["status"] for r in rows}))
        ps = [[r[f"p{k}"] for r in rows if r[f"p{k}"] is not None] for k in ks]
        smallest = " / ".join(f"{min(p):.2g}" if p else "-" for p in ps)
        below = " / ".join(str(sum(v < args.level for v in p)) for p in ps)
        rhos = [r["spearman"] for r in rows if r.get("spearman") is not None]
        rho = f"{min(rhos):.2f} to {max(rhos):.2f}" if rhos else "-"
        print(f"| {name} | {len(rows)} | {verdicts} | {smallest} | {below} | {rho} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
