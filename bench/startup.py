"""Start-up time and memory of the CPU servers (targets: healthy within 90 s, <= 4 GB RSS each).

    .venv/bin/python bench/startup.py [--roles treatment,control] [--base-port 8190]

Prints one line per server and the figures against their targets. Run it twice: the first start compiles and
warms caches; the figure that counts is the warm one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from servers.launch import Fleet
from servers.profiles import build_specs

GIB = 1024**3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="cpu-tiny")
    parser.add_argument("--roles", default="treatment,control")
    parser.add_argument("--base-port", type=int, default=8190)
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("BLACKBOX_CACHE", ".blackbox-cache")))
    args = parser.parse_args()
    roles = tuple(args.roles.split(","))
    specs = build_specs(args.profile, roles, base_port=args.base_port, cache_dir=args.cache_dir)
    with tempfile.TemporaryDirectory() as logs, Fleet(specs, Path(logs)) as fleet:
        started = time.monotonic()
        fleet.start()
        wall = time.monotonic() - started
        for url in fleet.urls.values():  # a little traffic so RSS includes the first request's allocations
            httpx.post(
                f"{url}/v1/chat/completions",
                timeout=120,
                json={
                    "messages": [{"role": "user", "content": "the code of amber is one two three ."}],
                    "max_tokens": 32,
                },
            )
        time.sleep(1.0)
        rss = fleet.rss_bytes()
        print(f"profile {args.profile}, roles {', '.join(roles)}, {os.cpu_count()} cores")
        for role in roles:
            print(f"  {role:10s} healthy after {fleet.startup_s[role]:6.1f} s   peak RSS {rss[role] / GIB:5.2f} GiB")
        worst = max(rss.values()) / GIB
        print(f"all healthy after {wall:.1f} s wall (target <= 90 s): {'ok' if wall <= 90 else 'MISSED'}")
        print(f"largest server RSS {worst:.2f} GiB (target <= 4 GB = 3.73 GiB): {'ok' if worst <= 3.73 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
