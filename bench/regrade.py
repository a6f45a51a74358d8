"""Re-judge kept run folders with this checkout's code and print what changed (a rule change's effect on real runs).

    .venv/bin/python bench/regrade.py runs/np [more folders ...] [--all] [--out FILE.jsonl]

Every folder under the given ones that holds a `verdict.json` and `exchanges.jsonl` is judged again
(`engine.rejudge`: the stored pre-run findings, the stored settings, this code's graders); nothing is sent and no
run folder is written. Prints one line per run whose status or error class changed (every run with --all), then
the counts (a folder a run left incomplete, such as one whose server died before the first answer, is counted
as not judged); --out keeps one JSON line per run (folder, stored and new verdict, the deciding grader's p-values).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blackbox.engine import rejudge


def folders(roots: list[Path]) -> list[Path]:
    found = {p.parent for root in roots for p in root.rglob("verdict.json") if (p.parent / "exchanges.jsonl").exists()}
    return sorted(found)


def label(status: str, error_class: str | None) -> str:
    return f"{status} {error_class}" if error_class else status


def smallest_p(findings: list[dict[str, Any]]) -> dict[str, float]:
    """Per grader, its smallest p-value (the grader's figures), to see how near a change came."""
    out: dict[str, float] = {}
    for f in findings:
        ps = (f.get("figures") or {}).get("p_values")
        if f.get("stage") == "grader" and ps:
            out[f["check"]] = min(float(v) for v in ps.values())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("roots", type=Path, nargs="+")
    ap.add_argument("--all", action="store_true", help="print every run, not only the changed ones")
    ap.add_argument("--out", type=Path, help="one JSON line per run")
    args = ap.parse_args(argv)
    runs = folders(args.roots)
    if not runs:
        print(f"no run folders (verdict.json + exchanges.jsonl) under {', '.join(map(str, args.roots))}")
        return 2
    tally: Counter[str] = Counter()
    lines = []
    for run in runs:
        stored = json.loads((run / "verdict.json").read_text())
        before = label(stored["status"], stored.get("error_class"))
        try:
            again = rejudge(run).verdict.to_json()
        except Exception as exc:  # a run that ended before its folder was complete (a dead server) has no history
            tally["not judged"] += 1
            if args.all:
                print(f"  {run}: {before}, not judged ({type(exc).__name__}: {exc})"[:200])
            continue
        after = label(again["status"], again.get("error_class"))
        p_before, p_after = smallest_p(stored.get("findings", [])), smallest_p(again.get("findings", []))
        changed = before != after
        tally["changed" if changed else "unchanged"] += 1
        tally[f"{before} -> {after}"] += 1
        if changed or args.all:
            ps = ", ".join(f"{c} {p_before.get(c, float('nan')):.3g} -> {p:.3g}" for c, p in p_after.items())
            print(f"{'*' if changed else ' '} {run}: {before} -> {after}  ({ps})")
        lines.append({"folder": str(run), "stored": before, "now": after, "p_stored": p_before, "p_now": p_after})
    print(
        f"{len(runs)} runs: {tally['changed']} changed, {tally['unchanged']} unchanged, {tally['not judged']} not "
        "judged (incomplete folders)"
    )
    for key, n in sorted(tally.items()):
        if "->" in key:
            print(f"  {n:4d}  {key}")
    if args.out:
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
