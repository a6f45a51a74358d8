"""Judge GPU run folders where they were made, so that only their verdicts need to travel.

    python -m servers.gpu.digest counts LOG FAULT            # "fired skipped" so far in a treatment log
    python -m servers.gpu.digest record RUN_DIR --case NAME --seed N [--fault F --before F,S --after F,S]
    python -m servers.gpu.digest load RUN_DIR --case NAME --seed N [--fault F --before F,S --after F,S]
        [--probe load|preemption]

A 64-conversation GPU run folder is ~120 MB (every answer's top-k logprobs), ~12 MB as xz, and a device call
brings back at most 64 MiB: a sitting of four triples makes ~16 runs a call. So each run is re-judged on the
device with this checkout's code (`engine.rejudge`, the path `blackbox grade` takes) and reduced to one record
in the shape of bench/results/faults-runs.jsonl (verdict, which grader caught it, the fewest leading
conversations that still FAIL, the fault's fires and skipped candidates during the run). The record goes to
RUN_DIR's parent as record.json; `plan.sh send` ships every record with the run's small files, and whole
folders (with the exchanges) only for some runs, so that a few can still be re-judged here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from blackbox import stats
from blackbox.engine import Rejudged, rejudge
from blackbox.evidence import RANKS
from blackbox.graders import LOGPROB, compared_positions, samples
from blackbox.history import Arm
from servers.vllm_plugin.faults import fired_counts, skipped_counts


def _bench() -> ModuleType:
    """bench/faults.py, whose record this is; bench/ is a folder of scripts, not an installed package."""
    if "bench_faults" in sys.modules:
        return sys.modules["bench_faults"]
    spec = importlib.util.spec_from_file_location("bench_faults", Path(__file__).parents[2] / "bench" / "faults.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def counts(log: Path, fault: str) -> tuple[int, int]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return fired_counts(text).get(fault, 0), skipped_counts(text).get(fault, 0)


def _pair(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 0
    fired, skipped = text.split(",")
    return int(fired), int(skipped)


def run_dir(path: Path) -> Path:
    """PATH if it is a finished run (its verdict.json), else the one finished run inside it (a series' folder)."""
    if (path / "verdict.json").exists():
        return path
    inner = [d for d in path.iterdir() if (d / "verdict.json").exists()] if path.is_dir() else []
    if len(inner) != 1:
        raise ValueError(f"{path}: no single finished run (verdict.json) in it")
    return inner[0]


def beyond_kth(treatment: Sequence[float], reference: Sequence[float], k: int) -> tuple[int, float] | None:
    """(m, p): treatment values beyond the reference's k-th largest, and P(M >= m) under exchangeability for that
    threshold alone."""
    found = stats.exceedance_at(treatment, reference, k)
    return (int(found.statistic), found.p_value) if found else None


def deviations(again: Rejudged, arm: str) -> dict[int, float]:
    """The logprob grader's finite decode-region deviations of one arm, by conversation. Confident flips are left
    out (the count test judges them)."""
    history, grading = again.history, again.config.grading
    n = compared_positions(history, grading)
    found = samples(history, arm, LOGPROB.pairs, LOGPROB.where, grading.hard_margin, n)
    return {s.unit: s.deviation for s in found if math.isfinite(s.deviation)}


def thresholds(again: Rejudged, ks: Sequence[int]) -> dict[str, Any]:
    """Treatment against reference deviations beyond each of the reference's k-th largest alone: what the
    exceedance test chose among, kept so that another rule can be weighed on runs whose exchanges did not
    travel."""
    t, r = list(deviations(again, Arm.TREATMENT).values()), list(deviations(again, Arm.REFERENCE).values())
    row: dict[str, Any] = {"n_t": len(t), "n_r": len(r)}
    for k in ks:
        got = beyond_kth(t, r, k)
        row[f"m{k}"], row[f"p{k}"] = got if got else (None, None)
    return row


def record(
    run_dir: Path, case: str, seed: int, fault: str | None, before: str | None, after: str | None
) -> dict[str, Any]:
    again = rejudge(run_dir)
    fired0, skipped0 = _pair(before)
    fired1, skipped1 = _pair(after)
    stored = json.loads((run_dir / "verdict.json").read_text())
    return {
        "case": case,
        "seed": seed,
        "probe": "multiturn",
        "length": again.config.conversations,
        "reference_ratio": again.config.reference_ratio,
        **_bench().outcome(again.verdict, again.history, again.config),
        "stored_status": stored.get("status"),
        "fault": fault,
        "fired": fired1 - fired0,
        "skipped": skipped1 - skipped0,
        "run": run_dir.name,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "thresholds": thresholds(again, range(1, RANKS + 1)),
    }


LOAD_SETTINGS = ("async_scheduling", "block_size", "num_gpu_blocks", "num_gpu_blocks_override", "enforce_eager")
# The probes run on a small KV cache: each one's trigger check (the pressure figures) and its grader's check.
PRESSURE_CHECKS = {"load": "load-trigger", "preemption": "preempt-trigger"}


def load_record(
    run_dir: Path,
    case: str,
    seed: int,
    fault: str | None,
    before: str | None,
    after: str | None,
    probe: str = "load",
) -> dict[str, Any]:
    """A small-cache run's record (the load or the preemption probe): its stored verdict, the trigger's pressure
    figures, the treatment's KV and scheduling settings, and the fault's fires, with the grader's figures under the
    probe's name. Read from the run's files as stored (the device runs this checkout's code); `needed` and
    `caught_by` come from judging it again, when that works."""
    stored = json.loads((run_dir / "verdict.json").read_text())
    findings = {f["check"]: f for f in stored.get("findings", [])}
    trigger, graded = findings.get(PRESSURE_CHECKS[probe]) or {}, findings.get(probe) or {}
    servers = json.loads((run_dir / "servers.json").read_text()) if (run_dir / "servers.json").exists() else {}
    treatment = servers.get("treatment") or {}
    settings = treatment.get("settings") or {}
    fired0, skipped0 = _pair(before)
    fired1, skipped1 = _pair(after)
    figures = graded.get("figures") or {}
    rec: dict[str, Any] = {
        "case": case,
        "seed": seed,
        "probe": probe,
        "status": stored.get("status"),
        "error_class": stored.get("error_class"),
        "reason": (stored.get("reason") or "")[:400],
        "hint": (stored.get("hint") or "")[:300],
        "wall_s": stored.get("elapsed_s"),
        "trigger": {"status": trigger.get("status"), "reason": trigger.get("reason"), **(trigger.get("figures") or {})},
        probe: {
            "status": graded.get("status"),
            **{k: figures.get(k) for k in ("n_subject", "n_yardstick", "p_values") if k in figures},
        },
        "unknown_checks": sorted(c for c, f in findings.items() if f.get("status") in ("UNKNOWN", "ERROR")),
        "vllm": treatment.get("version"),
        "treatment_settings": {k: settings.get(k) for k in LOAD_SETTINGS},
        "fault": fault,
        "fired": fired1 - fired0,
        "skipped": skipped1 - skipped0,
        "run": run_dir.name,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    try:
        again = rejudge(run_dir)
        out = _bench().outcome(again.verdict, again.history, again.config)
        rec.update(needed=out["needed"], caught_by=out["caught_by"], rejudged_status=out["status"])
    except Exception as exc:  # the stored verdict stands; say why it was not judged again
        rec["rejudge_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servers.gpu.digest")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("counts")
    c.add_argument("log", type=Path)
    c.add_argument("fault")
    for name in ("record", "load"):
        r = sub.add_parser(name)
        r.add_argument("run_dir", type=Path, help="a run's folder, or the folder holding exactly one")
        r.add_argument("--case", required=True)
        r.add_argument("--seed", type=int, required=True)
        r.add_argument("--fault")
        r.add_argument("--before", help="fired,skipped before the run")
        r.add_argument("--after", help="fired,skipped after the run")
        if name == "load":
            r.add_argument("--probe", choices=sorted(PRESSURE_CHECKS), default="load")
    args = parser.parse_args(argv)
    if args.command == "counts":
        print("{},{}".format(*counts(args.log, args.fault)))
        return 0
    try:
        run = run_dir(args.run_dir)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.command == "load":
        rec = load_record(run, args.case, args.seed, args.fault, args.before, args.after, args.probe)
    else:
        rec = record(run, args.case, args.seed, args.fault, args.before, args.after)
    (run.parent / "record.json").write_text(json.dumps(rec, sort_keys=True) + "\n")
    keys: tuple[str, ...] = ("case", "seed", "status", "caught_by", "needed", "fired", "skipped")
    if args.command == "load":  # the pressure (preemptions, evictions, hits) and the grader's p-values
        keys += ("error_class", "wall_s", "trigger", args.probe, "rejudged_status", "rejudge_error")
    print(json.dumps({k: rec.get(k) for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
