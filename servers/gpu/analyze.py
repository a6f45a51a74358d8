"""Summarise GPU run folders: verdict, trigger, acceptance, and hit-vs-recompute deviations by region.

    python -m servers.gpu.analyze RUN_DIR...
    python -m servers.gpu.analyze --positions RUN_DIR...    # the graders' tests by answer positions compared

Per run, for each arm that sent both a cache-hit request and its no-reuse twin (fresh cache_salt) on the same
server: how many pairs are bit-identical (tokens, logprobs, top-k), the first-token deviation (largest |Δ
logprob| over the top-k both list at position 0) and the largest deviation before the first differing token.
Pairs are split by where the hit ends: in the prefill-written region (cached tokens <= the turn-1 prompt, where
CPU vLLM is bit-exact) or in the decode-written region. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from blackbox import stats
from blackbox.compare import deviation
from blackbox.graders import EXACTNESS, LOGPROB, samples
from blackbox.history import Arm, History, Kind
from blackbox.store import load_history

PAIRS = ((Kind.PROBE, Kind.PROBE_FRESH), (Kind.TURN2, Kind.TURN2_FRESH))


def region_rows(history: History) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for arm in sorted(history.arms()):
        for hit_kind, fresh_kind in PAIRS:
            for plan in history.plans:
                hit, fresh = history.get(plan.index, arm, hit_kind), history.get(plan.index, arm, fresh_kind)
                if hit is None or fresh is None or not hit.ok or not fresh.ok or not hit.tokens or not fresh.tokens:
                    continue
                cached = hit.cached_tokens or 0
                region = "none" if cached == 0 else "prefill" if cached <= plan.turn1_prompt_tokens else "decode"
                parted = [
                    i for i, (a, b) in enumerate(zip(hit.tokens, fresh.tokens, strict=False)) if a.token != b.token
                ]
                rows.append(
                    {
                        "arm": arm,
                        "kind": hit_kind,
                        "region": region,
                        "identical": list(hit.tokens) == list(fresh.tokens),
                        "same_text": [t.token for t in hit.tokens] == [t.token for t in fresh.tokens],
                        "first": hit.tokens[0].gap(fresh.tokens[0]),
                        # the graders' statistic: top-k gaps up to the first differing token, inf for a sure flip
                        "max_before": deviation(hit.tokens, fresh.tokens, 1.0),
                        "diverge_at": parted[0] if parted else -1,
                    }
                )
    return rows


def _q(values: Sequence[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.3g}"


def summarise(run_dir: Path) -> str:
    _, history = load_history(run_dir)
    verdict = json.loads((run_dir / "verdict.json").read_text())
    checks = {f["check"]: f for f in verdict["findings"]}
    lines = [f"### {run_dir.parent.name} ({run_dir.name})", ""]
    lines.append(f"verdict **{verdict.get('status')}**: {verdict.get('reason', '')[:200]}")
    for name in ("trigger", "drafter-live", "exactness", "logprob"):
        if name in checks:
            lines.append(f"- {name}: {checks[name]['status']}: {checks[name]['reason'][:240]}")
    header = (
        "| arm | request | region | pairs | bit-identical | same tokens | first-token dev median / p95 / max |"
        " largest pre-divergence dev median / max |"
    )
    lines += ["", header, "|---|---|---|---|---|---|---|---|"]
    rows = region_rows(history)
    keys = sorted({(r["arm"], r["kind"], r["region"]) for r in rows})
    for arm, kind, region in keys:
        group = [r for r in rows if (r["arm"], r["kind"], r["region"]) == (arm, kind, region)]
        first = [float(r["first"]) for r in group if r["first"] is not None]  # type: ignore[arg-type]
        before = [float(r["max_before"]) for r in group if r["max_before"] is not None]  # type: ignore[arg-type]
        lines.append(
            f"| {arm} | {kind} | {region} | {len(group)} | {sum(bool(r['identical']) for r in group)} | "
            f"{sum(bool(r['same_text']) for r in group)} | {_q(first, 0.5)} / {_q(first, 0.95)} / "
            f"{max(first, default=float('nan')):.3g} | {statistics.median(before) if before else float('nan'):.3g}"
            f" / {max(before, default=float('nan')):.3g} |"
        )
    return "\n".join(lines) + "\n"


def by_positions(run_dir: Path, counts: Sequence[int | None] = (1, 2, 4, 8, None)) -> str:
    """Treatment against reference, per region, comparing only the first N answer positions (None: whole
    answers): the exceedance and (unmargined) Mann-Whitney p-values the graders' tests give at each N."""
    _, history = load_history(run_dir)
    lines = [f"{run_dir.parent.name}: exceedance p (shift p) by positions compared", ""]
    lines += ["| positions | prefill region | decode region |", "|---|---|---|"]
    for n in counts:
        cells = []
        for c in (EXACTNESS, LOGPROB):
            t = [x.deviation for x in samples(history, Arm.TREATMENT, c.pairs, c.where, 1.0, n)]
            r = [x.deviation for x in samples(history, Arm.REFERENCE, c.pairs, c.where, 1.0, n)]
            if not t or not r:
                cells.append("-")
                continue
            exceed, shift = stats.exceedance(t, r).p_value, stats.mann_whitney_greater(t, r).p_value
            cells.append(f"{exceed:.2g} ({shift:.2g})")
        lines.append(f"| {n or 'whole answer'} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servers.gpu.analyze", description=__doc__.splitlines()[0])
    p.add_argument("--positions", action="store_true", help="the graders' tests by answer positions compared")
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    args = p.parse_args(argv)
    for run in args.runs:
        print(by_positions(run) if args.positions else summarise(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
