"""The pytest front end: a missing endpoint errors the test, it never skips it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SMOKE = "def test_no_corruption(blackbox_result):\n    blackbox_result.assert_pass()\n"


def test_missing_endpoints_error_instead_of_skipping(tmp_path: Path) -> None:
    (tmp_path / "test_smoke.py").write_text(SMOKE)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path / "test_smoke.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "blackbox needs --blackbox-treatment URL and --blackbox-control URL" in output
    assert "skipped" not in output and " passed" not in output
