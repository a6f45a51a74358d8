"""Several bench/faults.py cases on one fleet where their servers are the same (fewer starts under the lock).

    .venv/bin/python bench/sitting.py --cases NAME,NAME,... [--seeds 1] [--seed-start 0] --keep-runs DIR
        [--runs FILE] [--table FILE] [--base-port 8300] [--budget-min M]

Cases are bench/faults.py's (`--list` there); those whose fleet is the same (profile, fault and its sporadic
setting, speculative tokens, roles) share one start. Each run is recorded exactly as bench/faults.py records it.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "bench/faults.py")
assert _spec is not None and _spec.loader is not None
faults = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = faults
_spec.loader.exec_module(faults)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed-start", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--race-rounds", type=int, default=faults.RaceSettings.rounds_per_size)
    parser.add_argument("--reference-ratio", type=int, default=faults.RunConfig.reference_ratio)
    parser.add_argument("--extend-to", type=int, default=0)
    parser.add_argument("--redo", action="store_true")
    parser.add_argument("--base-port", type=int, default=8300)
    parser.add_argument("--cache-dir", type=Path, default=Path(".blackbox-cache"))
    parser.add_argument("--runs", type=Path, default=faults.RUNS_FILE)
    parser.add_argument("--table", type=Path, default=faults.TABLE_FILE)
    parser.add_argument("--keep-runs", type=Path, required=True)
    parser.add_argument("--budget-min", type=float, default=0)
    args = parser.parse_args()
    cases = [c for name in args.cases.split(",") for c in faults.select(name)]
    stamp = {
        "command": shlex.join(["python", "bench/sitting.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": faults._commit(),
    }
    deadline = time.monotonic() + args.budget_min * 60 if args.budget_min else float("inf")
    groups: dict[tuple[object, ...], list[faults.Case]] = {}
    for c in cases:
        key = (
            c.profile,
            c.fault,
            c.sporadic,
            c.shape,
            c.spec_tokens,
            c.reference,
            c.alone,
            c.treatment_args,
            c.reference_args,
        )
        groups.setdefault(key, []).append(c)
    args.keep_runs.mkdir(parents=True, exist_ok=True)
    made = 0
    for group in groups.values():
        todo = [(c, s) for c in group for s in faults.pending_seeds(c, args)]
        if not todo or time.monotonic() > deadline:
            continue
        fleet = faults.fleet_for(group[0], args, args.keep_runs / f"servers-{group[0].name.replace(' ', '_')}")
        with fleet, fleet.handle_signals():
            fleet.start()
            for seed in sorted({s for _, s in todo}):
                for case in (c for c, s in todo if s == seed):
                    if time.monotonic() > deadline:
                        break
                    made += faults.run_seed(case, fleet, seed, args, stamp, args.keep_runs)
    args.table.write_text(faults.table(faults.load_runs(args.runs)))
    print(f"{made} runs made; {args.table} rebuilt from {args.runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
