"""report.html from a run folder alone: what it shows, what it leaves out and says so, and that writing it can
never change a verdict or an exit code. (tests/test_report_browser.py opens the pages in Chromium.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import run_folders

from blackbox import errors, html_report, plots
from blackbox.cli import main
from blackbox.secrets import Redactor
from blackbox.store import RunStore
from blackbox.verdict import Finding, merge


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return run_folders.three(tmp_path_factory.mktemp("runs"))


def test_a_fail_lists_each_counted_conversation_with_its_diff_and_replay(folders: dict[str, Path]) -> None:
    page = html_report.render(folders["FAIL"])
    stored = run_folders.stored_verdict(folders["FAIL"])
    logprob = next(f for f in stored["findings"] if f["check"] == "logprob")
    counted = sorted({m["unit"] for m in logprob["figures"]["mismatches"]})
    assert counted == [3, 5, 8, 13, 17, 21, 27, 30]  # the six far hits and the two confident flips
    assert re.findall(r"<h3>Conversation (\d+)</h3>", page) == [str(c) for c in counted]
    assert page.count('<tr class="differs">') == 2  # the flipped token, in conversations 5 and 17
    assert "sh replay/c005-treatment-turn2.sh" in page
    assert "${BLACKBOX_API_KEY:-}" in page  # the replay reads the key from the variable, never holds it
    # the power statement a FAIL's reason lacks
    assert "in ≥ " in html_report.power_statement(logprob) and "with probability 0.95" in page


def test_a_pass_flags_nothing_and_keeps_one_example_replay(folders: dict[str, Path]) -> None:
    page = html_report.render(folders["PASS"])
    assert "<h3>Conversation" not in page
    assert "None (11 replay scripts of one conversation are kept as an example)" in page


def _setup_error_folder(root: Path) -> Path:
    """What a run that stopped at its first check leaves: the config and the verdict, no workload."""
    store = RunStore(root, "mismatch")
    store.write_json("config.json", run_folders.CONFIG.to_json())
    error = errors.ConfigMismatch("treatment: /metrics has no vllm:* series", hint="point --treatment at vLLM")
    store.write_json("verdict.json", {**merge([Finding.from_error("setup", error)]).to_json(), "elapsed_s": 0.4})
    store.close()
    return store.path


def test_a_folder_without_a_workload_gets_a_banner_and_a_note_per_missing_figure(tmp_path: Path) -> None:
    run_dir = _setup_error_folder(tmp_path)
    assert main(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    assert '<span id="verdict">ERROR</span>' in page and '<b id="exit-code">3</b>' in page
    assert "ConfigMismatch" in page and "point --treatment at vLLM" in page
    assert "<img" not in page
    notes = re.findall(r"<li>([^<]+?): ([^<]+)</li>", page.split("<h2>Figures</h2>")[1].split("</section>")[0])
    assert [n for n, _ in notes] == [
        "decode-region deviations",
        "prefill-region deviations",
        "where turn-2 hits resumed",
        "drafter acceptance",
        "hit rate by offset",
        "request timeline",
    ]


def test_a_killed_run_without_verdict_json_is_no_verdict(tmp_path: Path) -> None:
    run_dir = _setup_error_folder(tmp_path)
    (run_dir / "verdict.json").unlink()
    page = html_report.render(run_dir)
    assert '<span id="verdict">NO VERDICT</span>' in page and "killed before it finished" in page


def test_a_figure_that_fails_to_draw_is_a_note_and_the_rest_are_drawn(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> str:
        raise ValueError("no such axis")

    monkeypatch.setattr(plots, "timeline", broken)
    page = html_report.render(folders["PASS"])
    assert "request timeline: could not be drawn (ValueError: no such axis)" in page
    assert page.count("<img ") == 4


def test_a_report_that_cannot_be_written_leaves_the_verdict_and_exit_code(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    run_dir = folders["FAIL"]
    before = (run_dir / "verdict.json").read_text()

    def broken(run_dir: Path, **kwargs: object) -> str:
        raise RuntimeError("a bug in the report")

    monkeypatch.setattr(html_report, "render", broken)
    assert main(["grade", str(run_dir)]) == 1  # the FAIL's exit code, report or no report
    err = capfd.readouterr().err
    assert "report.html not written (RuntimeError); the verdict stands" in err
    assert "a bug in the report" in (run_dir / "traceback-report.txt").read_text()
    assert (run_dir / "verdict.json").read_text() == before


def test_grade_rewrites_the_report_with_the_re_judged_verdict(folders: dict[str, Path]) -> None:
    run_dir = folders["UNKNOWN"]
    (run_dir / "report.html").unlink(missing_ok=True)
    assert main(["grade", str(run_dir)]) == 2
    page = (run_dir / "report.html").read_text()
    assert "Re-judged by <code>blackbox grade</code>" in page and "; the same verdict." in page


def test_write_redacts_with_the_runs_key(tmp_path: Path) -> None:
    run_dir = _setup_error_folder(tmp_path)
    (run_dir / "command.txt").write_text(f"blackbox run --note {run_folders.CANARY}\n")  # as if a file held it
    page = html_report.write(run_dir, redact=Redactor(run_folders.CANARY)).read_text()
    assert run_folders.CANARY not in page and "[REDACTED]" in page


def test_report_on_a_folder_that_is_not_a_run_is_a_usage_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path)]) == errors.UsageError.exit_code
    assert "is not a blackbox run folder" in capfd.readouterr().err


def test_a_folder_from_before_request_start_times_draws_requests_in_order(tmp_path: Path) -> None:
    run_dir = run_folders.write(tmp_path, "old", run_folders.history(run_folders.noise(run_folders.N)))
    lines = (run_dir / "exchanges.jsonl").read_text().splitlines()
    old = [json.dumps({k: v for k, v in json.loads(line).items() if k != "started_s"}) for line in lines]
    (run_dir / "exchanges.jsonl").write_text("\n".join(old) + "\n")
    page = html_report.render(run_dir)
    assert "This run folder stores no request start times: requests are in the order recorded." in page
    assert page.count("<img ") == 5


def test_a_cold_race_fail_lists_its_rounds_not_conversations(tmp_path: Path) -> None:
    run_dir = _setup_error_folder(tmp_path)
    race = Finding.from_error(
        "race-divergence",
        errors.CorruptionDetected("follow-ups deviate more than the cold racers'"),
        mismatches=[{"unit": 4, "kind": "follow-0", "deviation": 1.5}, {"unit": 1, "kind": "follow-2", "deviation": 2}],
    )
    (run_dir / "verdict.json").write_text(json.dumps(merge([race]).to_json()))
    page = html_report.render(run_dir)
    assert "Cold-race rounds counted against the treatment: 1, 4." in page
    assert "<h3>Conversation" not in page


def test_a_hit_geometry_sweep_is_drawn_by_offset_from_its_finding(tmp_path: Path) -> None:
    run_dir = _setup_error_folder(tmp_path)
    table = {
        "1": {"prompt_tokens": [17, 33], "hit": [16, 32], "ceiling": [16, 32]},
        "8": {"prompt_tokens": [24, 40], "hit": [0, 0], "ceiling": [16, 32]},
        "15": {"prompt_tokens": [15, 31], "hit": [None, 16], "ceiling": [0, 16]},  # the first could not hit
    }
    sweep = Finding.from_error(
        "hit-geometry",
        errors.CacheNotLive("offsets 8 tokens past one hit nothing"),
        block_size=16,
        by_offset=table,
        offsets_dead=[8],
    )
    (run_dir / "verdict.json").write_text(json.dumps(merge([sweep]).to_json()))
    page = html_report.render(run_dir)
    assert '<img alt="hit rate by offset"' in page and "Nothing hit at offsets 8." in page
    assert html_report._offset_rates(table) == {1: (2, 2), 8: (0, 2), 15: (1, 1)}
