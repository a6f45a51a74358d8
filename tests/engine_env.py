"""Where the engine tests keep the tiny model and which loopback ports their servers use."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
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


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py imported as `bench_NAME` (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module
