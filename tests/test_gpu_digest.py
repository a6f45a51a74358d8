"""The device-side digest of a GPU run: fault counts read from a server log, and one record per run folder."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from blackbox.verdict import Finding, Status, Verdict
from servers.gpu import digest

LOG = """\
INFO engine started
WARNING [vllm.blackbox] BLACKBOX_FAULT skipped name=eagle-overrun count=1 block=0a1b
WARNING [vllm.blackbox] BLACKBOX_FAULT fired name=eagle-overrun count=1 block=2c3d
WARNING [vllm.blackbox] BLACKBOX_FAULT skipped name=eagle-overrun count=2 block=4e5f
WARNING [vllm.blackbox] BLACKBOX_FAULT fired name=eagle-overrun count=2 block=6a7b
WARNING [vllm.blackbox] BLACKBOX_FAULT skipped name=eagle-overrun count=3 block=8c9d
"""


def test_counts_are_the_highest_logged_per_fault_and_zero_without_a_log(tmp_path: Path) -> None:
    log = tmp_path / "treatment.log"
    log.write_text(LOG)
    assert digest.counts(log, "eagle-overrun") == (2, 3)
    assert digest.counts(log, "stale-checkpoint") == (0, 0)
    assert digest.counts(tmp_path / "absent.log", "eagle-overrun") == (0, 0)


def _run_folder(tmp_path: Path, status: str) -> Path:
    run = tmp_path / "eagle-a-s3" / "20261202-034317-s3"
    run.mkdir(parents=True)
    (run / "verdict.json").write_text(json.dumps({"status": status}))
    return run


def _rejudged_pass() -> SimpleNamespace:
    verdict = Verdict(Status.PASS, "judged again", None, (Finding.passed("logprob", "within the reference's"),), 0)
    return SimpleNamespace(verdict=verdict, history=None, config=SimpleNamespace(conversations=64, reference_ratio=2))


def test_a_record_carries_the_verdict_judged_again_and_the_fires_during_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run_folder(tmp_path, "PASS")
    monkeypatch.setattr(digest, "rejudge", lambda folder: _rejudged_pass())

    # The series hands the run's parent folder (plan.sh: $W/runs/NAME); the record lands beside the run.
    assert digest.main(["record", str(run.parent), "--case", "eagle-overrun 0.2 block", "--seed", "3",
                        "--fault", "eagle-overrun", "--before", "5,40", "--after", "16,93"]) == 0  # fmt: skip
    rec = json.loads((run.parent / "record.json").read_text())
    assert (rec["case"], rec["seed"], rec["length"], rec["reference_ratio"]) == ("eagle-overrun 0.2 block", 3, 64, 2)
    assert (rec["status"], rec["stored_status"], rec["caught_by"], rec["needed"]) == ("PASS", "PASS", [], None)
    assert (rec["fired"], rec["skipped"], rec["run"]) == (11, 53, run.name)


def test_a_folder_without_one_finished_run_gets_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(digest, "rejudge", lambda folder: pytest.fail("nothing to judge"))
    (tmp_path / "cut").mkdir()  # a run the call's deadline interrupted: no verdict.json
    assert digest.main(["record", str(tmp_path), "--case", "x", "--seed", "0"]) == 2
    assert "no single finished run" in capsys.readouterr().err
    assert not (tmp_path / "record.json").exists()
