"""How long report.html takes to write (target: a few seconds for a 32-conversation run).

    .venv/bin/python bench/report.py RUN_DIR...

Prints the import cost once (matplotlib is imported only when a report is drawn), then per folder the CPU and
wall seconds of `html_report.write` and the page's size. CPU seconds are the figure to compare on a shared
machine: wall time there mostly measures the other processes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 3
    cpu, wall = time.process_time(), time.monotonic()
    from blackbox import html_report, plots  # noqa: F401  (plots: the import a first report pays)

    print(f"import: {time.process_time() - cpu:.2f} s CPU, {time.monotonic() - wall:.2f} s wall")
    for name in argv:
        cpu, wall = time.process_time(), time.monotonic()
        page = html_report.write(Path(name))
        print(
            f"{name}: {time.process_time() - cpu:.2f} s CPU, {time.monotonic() - wall:.2f} s wall, "
            f"{page.stat().st_size // 1024} KiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
