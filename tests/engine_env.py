"""Where the engine tests keep the tiny model and which loopback ports their servers use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("BLACKBOX_CACHE", ROOT / ".blackbox-cache"))
BASE_PORT = int(os.environ.get("BLACKBOX_TEST_PORT", "8170"))


def blackbox_cli(out: Path, *args: str) -> tuple[int, str, Path, dict[str, Any]]:
    """Run `blackbox run ARGS --out OUT` as a user would; return its exit code, output, run folder and verdict."""
    cmd = [sys.executable, "-m", "blackbox.cli", "run", *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    output = proc.stdout + proc.stderr
    runs = sorted(p for p in out.iterdir() if (p / "verdict.json").exists()) if out.exists() else []
    assert runs, output
    return proc.returncode, output, runs[-1], json.loads((runs[-1] / "verdict.json").read_text())
