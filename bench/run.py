"""Wall time and tester memory of the default run on the CPU pair (targets: <= 3 min once servers are up,
tester < 200 MB RSS).

    .venv/bin/python bench/run.py [--conversations 32] [--seeds 0,1] [--base-port 8195]

Starts treatment, control and reference, then runs `blackbox run` as a child process per seed and prints its
wall time, peak RSS (getrusage of the child) and verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servers.launch import Fleet
from servers.profiles import build_specs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--base-port", type=int, default=8195)
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("BLACKBOX_CACHE", ".blackbox-cache")))
    args = parser.parse_args()
    roles = ("treatment", "control", "reference")
    specs = build_specs("cpu-tiny", roles, base_port=args.base_port, cache_dir=args.cache_dir)
    with tempfile.TemporaryDirectory() as tmp, Fleet(specs, Path(tmp) / "servers") as fleet:
        fleet.start()
        print(f"servers up ({', '.join(f'{r} {s:.0f} s' for r, s in fleet.startup_s.items())})")
        print(f"{'seed':>4} {'conv':>4} {'wall s':>7} {'RSS MB':>7}  verdict")
        for seed in (int(s) for s in args.seeds.split(",")):
            cmd = [
                sys.executable,
                "-m",
                "blackbox.cli",
                "run",
                "--treatment",
                fleet.urls["treatment"],
                "--control",
                fleet.urls["control"],
                "--reference",
                fleet.urls["reference"],
                "--conversations",
                str(args.conversations),
                "--seed",
                str(seed),
                "--out",
                tmp,
            ]
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            started = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            wall = time.monotonic() - started
            rss_mb = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before) / 1024
            verdict = "?"
            for path in Path(tmp).glob(f"*-s{seed}/verdict.json"):
                data = json.loads(path.read_text())
                verdict = f"{data['status']} {data.get('error_class') or ''}".strip()
            print(f"{seed:>4} {args.conversations:>4} {wall:7.1f} {rss_mb:7.0f}  {verdict} (exit {proc.returncode})")
        print("targets: wall <= 180 s, RSS < 200 MB (ru_maxrss is the peak over all children so far)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
