"""The console progress line: one count for the whole run, written as a terminal or a log file wants it."""

from __future__ import annotations

import io

from blackbox.report import ProgressLine


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_the_first_and_last_lines_and_one_denominator() -> None:
    out = io.StringIO()
    line = ProgressLine(out, every_s=3600)
    for done in range(0, 49):
        line(done, 48, "conversation done")
    line(48, 48, "waiting for counters to settle")
    lines = out.getvalue().splitlines()
    assert [ln.split("] ")[1].split(" ")[0] for ln in lines] == ["0/48", "48/48", "48/48"]


def test_a_run_that_drives_no_conversation_prints_no_count() -> None:
    out = _Terminal()
    ProgressLine(out)(0, 0, "cold race")
    assert out.getvalue().startswith("\r\033[K[") and out.getvalue().endswith("] cold race")
    assert "conversations" not in out.getvalue()
