"""Wall time of the default `--probe all` run on the CPU trio, probe by probe (issue 23's budget: under 10 minutes on
2 cores).

    .venv/bin/python bench/probe_all.py [--seed 0] [--base-port 8360] [--out runs/probe-all] [--write FILE]

Starts the clean `cpu-tiny-fragmented` trio (treatment, control, reference; the fragmented budget so the cold race
can fragment, which the plain profile cannot), runs `blackbox run --probe all` with every other setting at its
default, and prints the verdict, the run's wall time and each probe's span (first request sent to last answer, from
the run folder's exchanges). `--write` appends the figures, the command and the date to a markdown file.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servers.launch import Fleet  # noqa: E402
from servers.profiles import build_specs  # noqa: E402

PROFILE = "cpu-tiny-fragmented"
# First conversation id of each probe (blackbox/probes/*.py FIRST), in the order they run.
FIRST_IDS = (
    ("multiturn", 0),
    ("cold-race", 1_000),
    ("held-prefix", 20_000),
    ("hit-geometry", 30_000),
    ("short-follow-up", 40_000),
    ("load", 50_000),
)


def probe_of(conversation: int) -> str:
    """The probe a conversation id belongs to; the engine's own requests (gates, comparability) have ids below 0."""
    return ([name for name, first in FIRST_IDS if conversation >= first] or ["checks"])[-1]


def spans(folder: Path) -> dict[str, float]:
    """Seconds from each probe's first request to its last answer."""
    edges: dict[str, list[float]] = {}
    for line in (folder / "exchanges.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("started_s") is None:
            continue
        lo, hi = e["started_s"], e["started_s"] + e["elapsed_s"]
        span = edges.setdefault(probe_of(e["conversation"]), [lo, hi])
        span[0], span[1] = min(span[0], lo), max(span[1], hi)
    return {name: round(hi - lo, 1) for name, (lo, hi) in edges.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-port", type=int, default=8360)
    p.add_argument("--out", type=Path, default=ROOT / "runs/probe-all")
    p.add_argument("--cache-dir", type=Path, default=ROOT / ".blackbox-cache")
    p.add_argument("--write", type=Path)
    args = p.parse_args()
    specs = build_specs(
        PROFILE, ("treatment", "control", "reference"), base_port=args.base_port, cache_dir=args.cache_dir
    )
    with Fleet(specs, args.out / "servers") as fleet, fleet.handle_signals():
        started = time.monotonic()
        fleet.start()
        up_s = time.monotonic() - started
        argv = [
            str(ROOT / ".venv/bin/blackbox"), "run", "--probe", "all", "--seed", str(args.seed),
            "--treatment", fleet.urls["treatment"], "--control", fleet.urls["control"],
            "--reference", fleet.urls["reference"], "--out", str(args.out / "runs"),
        ]  # fmt: skip
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        wall_s = time.monotonic() - started
    folder = max((args.out / "runs").iterdir(), key=lambda f: f.stat().st_mtime)
    verdict = json.loads((folder / "verdict.json").read_text())
    figures = spans(folder)
    status = verdict["status"] + (f" {verdict['error_class']}" if verdict.get("error_class") else "")
    print(f"--probe all on {PROFILE}, seed {args.seed}: {status}, exit {done.returncode}")
    print(f"  servers up {up_s:.0f} s; run {wall_s:.0f} s; per probe: {figures}")
    if args.write:
        command = shlex.join(["python", "bench/probe_all.py", *sys.argv[1:]])
        row = (
            f"| {time.strftime('%Y-%m-%d', time.gmtime())} | {args.seed} | {status} | {wall_s:.0f} s | {up_s:.0f} s | "
            + ", ".join(f"{k} {v:.0f} s" for k, v in figures.items())
            + f" | `{command}` |\n"
        )
        with args.write.open("a") as fh:
            fh.write(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
