"""Conversations a run with --detect needs to a FAIL and to a PASS, on the CPU pair, against the fixed lengths.

    python bench/sequential.py --cases 'clean,eagle-overrun' --detect 0.34,0.2 --seeds 2 [--round 8]
        [--max-conversations 160] [--keep-runs runs/bench-seq] [--budget-min M]

For each fault case of bench/faults.py named (its servers, its fault and sporadic rate) and each --detect, runs
`blackbox run --detect Q` (through `engine.run`, as the CLI does) for each seed, and records the look it stopped
at, the treatment conversations it sent, the verdict and the wall time in bench/results/sequential.jsonl (one
line per run, with the command, date and commit); bench/results/sequential.md is rebuilt from all of them, next
to what the fixed-length design needs for the same coverage (the PASS sentence's "would need about N").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import shlex
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from blackbox.engine import run
from blackbox.store import RunStore

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "bench/faults.py")
assert _spec is not None and _spec.loader is not None
faults = importlib.util.module_from_spec(_spec)
sys.modules["bench_faults"] = faults
_spec.loader.exec_module(faults)

RESULTS = Path(__file__).resolve().parent / "results"
RUNS_FILE = RESULTS / "sequential.jsonl"
TABLE_FILE = RESULTS / "sequential.md"


def one(case: faults.Case, fleet: Any, seed: int, detect: float, args: argparse.Namespace) -> dict[str, Any]:
    base = faults.run_config(case, fleet.urls, seed, args, args.max_conversations)
    config = dataclasses.replace(
        base, detect=detect, round_conversations=args.round, max_conversations=args.max_conversations
    )
    folder = args.keep_runs / f"{case.name.replace(' ', '_')}-s{seed}-d{detect:g}"
    shutil.rmtree(folder, ignore_errors=True)
    store = RunStore(folder.parent, folder.name)
    fired0, skipped0 = faults.fault_counts(case, fleet)
    started = time.monotonic()
    try:
        result = asyncio.run(run(config, store))
    finally:
        store.close()
    fired1, skipped1 = faults.fault_counts(case, fleet)
    verdict = result.verdict
    seq = next((f.figures for f in verdict.findings if f.check == "sequential"), {})
    logprob = next((f.figures for f in verdict.findings if f.check == "logprob"), {})
    return {
        "case": case.name,
        "seed": seed,
        "detect": detect,
        "round": args.round,
        "max_conversations": args.max_conversations,
        "status": verdict.status.value,
        "error_class": verdict.error_class,
        "stopped_at_look": seq.get("stopped_at_look"),
        "planned_pass_look": seq.get("planned_pass_look"),
        "conversations": seq.get("conversations"),
        "coverage": (seq.get("looks") or [{}])[-1].get("coverage"),
        "fixed_for_20pct": logprob.get("conversations_for_20pct"),
        "fixed_for_10pct": logprob.get("conversations_for_10pct"),
        "fired": fired1 - fired0,
        "skipped": skipped1 - skipped0,
        "wall_s": round(time.monotonic() - started, 1),
        "reason": verdict.reason[:300],
    }


def table(rows: list[dict[str, Any]]) -> str:
    # Runs before 2026-12-05 spent alpha linearly over rounds of 16 (no plan): rows of their own.
    groups: dict[tuple[str, float, int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["case"], r["detect"], r["round"], r.get("planned_pass_look") or 0)].append(r)
    out = [
        "# Runs that stop when the answer is known (`--detect`), CPU pair\n",
        "Rebuilt by `bench/sequential.py` from `sequential.jsonl` (each line has its command, date and commit). "
        "*Conversations*: treatment conversations sent before the run stopped (the reference ran twice as many). "
        "*Fixed needs*: what the last look's PASS sentence says a run would need for 20% and 10% at that look's "
        "level. For comparison, a fixed-length run of 32 conversations (reference 2x) covers about 34% at the whole "
        "alpha (`bench/results/faults.md`, clean rows). *Round, plan*: conversations a round, and the look by which "
        "80% of alpha is spent (`linear`: alpha spread evenly over the looks, the design before 2026-12-05). "
        "*Fired*: times the fault fired in each run (over its candidates, fired and skipped, where recorded).\n",
        "| case | --detect | round, plan | runs | FAIL | PASS | UNKNOWN/ERROR | conversations (mean, range) | looks | "
        "fixed needs 20% / 10% | fired | wall (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (case, detect, round_, plan), rs in sorted(groups.items()):
        n = [r["conversations"] for r in rs if r["conversations"] is not None]
        looks = [r["stopped_at_look"] for r in rs if r["stopped_at_look"] is not None]
        fixed20 = [r["fixed_for_20pct"] for r in rs if r.get("fixed_for_20pct")]
        fixed10 = [r["fixed_for_10pct"] for r in rs if r.get("fixed_for_10pct")]
        count = {s: sum(r["status"] == s for r in rs) for s in ("FAIL", "PASS")}
        other = len(rs) - sum(count.values())
        out.append(
            f"| {case} | {detect:g} | {round_}, {f'look {plan}' if plan else 'linear'} | {len(rs)} | {count['FAIL']} | "
            f"{count['PASS']} | {other} | "
            + (f"{statistics.mean(n):.1f} ({min(n)}-{max(n)})" if n else "-")
            + f" | {', '.join(map(str, looks)) or '-'} | "
            + (f"{max(fixed20)} / {max(fixed10)}" if fixed20 and fixed10 else "-")
            + f" | {', '.join(map(_fired, rs)) if any(r.get('fired') for r in rs) else '-'}"
            + f" | {statistics.mean(r['wall_s'] for r in rs):.0f} s |"
        )
    return "\n".join(out + struck(rows)) + "\n"


def _fired(r: dict[str, Any]) -> str:
    return f"{r['fired']}/{r['fired'] + r['skipped']}" if r.get("skipped") is not None else str(r["fired"])


def struck(rows: list[dict[str, Any]]) -> list[str]:
    """Sporadic faults against what a PASS promises: FAIL among the runs whose fault fired at least Q times per
    decode-region resume sent (Q the --detect asked), and among the rest. A fire may land on a boundary no graded
    resume reads, so the first group may hold runs below Q; the split says which PASS runs broke no promise."""
    resumes = {c.name: c.resumes for c in faults.CASES if c.fault is not None}
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["case"] in resumes and r.get("planned_pass_look") and r.get("conversations"):
            groups[(r["case"], r["detect"])].append(r)
    if not groups:
        return []
    out = [
        "",
        "## Sporadic faults by how often they struck",
        "",
        "*At or above*: runs whose fault fired at least --detect times the decode-region resumes they sent "
        "(conversations x resumes), the share a PASS at that --detect promises to see.",
        "",
        "| case | --detect | at or above: FAIL / runs | below: FAIL / runs | PASS runs' fires per resume |",
        "|---|---|---|---|---|",
    ]

    def share(r: dict[str, Any]) -> float:
        return float(r["fired"]) / (r["conversations"] * resumes[r["case"]])

    def fails(rs: list[dict[str, Any]]) -> str:
        return f"{sum(r['status'] == 'FAIL' for r in rs)} / {len(rs)}"

    for (case, detect), rs in sorted(groups.items()):
        above = [r for r in rs if share(r) >= detect]
        below = [r for r in rs if share(r) < detect]
        passes = ", ".join(f"{share(r):.2f}" for r in rs if r["status"] == "PASS") or "-"
        out.append(f"| {case} | {detect:g} | {fails(above)} | {fails(below)} | {passes} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", required=True, help="bench/faults.py case names or groups, comma-separated")
    parser.add_argument("--detect", default="0.34,0.2", help="fractions, comma-separated")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--seed-start", type=int, default=100)
    parser.add_argument("--round", type=int, default=faults.RunConfig.round_conversations)
    parser.add_argument("--max-conversations", type=int, default=faults.RunConfig.max_conversations)
    parser.add_argument("--conversations", type=int, default=32, help="(the case's other probes' length)")
    parser.add_argument("--race-rounds", type=int, default=faults.RaceSettings.rounds_per_size)
    parser.add_argument("--reference-ratio", type=int, default=faults.RunConfig.reference_ratio)
    parser.add_argument("--base-port", type=int, default=8300)
    parser.add_argument("--cache-dir", type=Path, default=Path(".blackbox-cache"))
    parser.add_argument("--keep-runs", type=Path, default=Path("runs/bench-seq"))
    parser.add_argument("--budget-min", type=float, default=0, help="start no run after this many minutes")
    args = parser.parse_args()
    stamp = {
        "command": shlex.join(["python", "bench/sequential.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": faults._commit(),
    }
    deadline = time.monotonic() + args.budget_min * 60 if args.budget_min else float("inf")
    detects = [float(d) for d in args.detect.split(",")]
    args.keep_runs.mkdir(parents=True, exist_ok=True)
    for case in (c for name in args.cases.split(",") for c in faults.select(name)):
        if time.monotonic() > deadline:
            break
        fleet = faults.fleet_for(case, args, args.keep_runs / f"servers-{case.name.replace(' ', '_')}")
        with fleet, fleet.handle_signals():
            fleet.start()
            for seed in range(args.seed_start, args.seed_start + args.seeds):
                for detect in detects:
                    if time.monotonic() > deadline:
                        break
                    row = {**one(case, fleet, seed, detect, args), **stamp}
                    faults.append_run(RUNS_FILE, row)
                    print(
                        f"{case.name} seed {seed} --detect {detect:g}: {row['status']} after "
                        f"{row['conversations']} conversations (look {row['stopped_at_look']}), {row['wall_s']} s",
                        flush=True,
                    )
    rows = faults.load_runs(RUNS_FILE)
    TABLE_FILE.write_text(table(rows))
    print(f"{TABLE_FILE} rebuilt from {len(rows)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
