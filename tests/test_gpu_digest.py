"""The device-side digest of a GPU run: fault counts read from a server log, and one record per run folder."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from blackbox.evidence import Sample
from blackbox.history import Arm
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
    monkeypatch.setattr(digest, "thresholds", lambda again, ks: {"ks": list(ks)})

    # The series hands the run's parent folder (plan.sh: $W/runs/NAME); the record lands beside the run.
    assert digest.main(["record", str(run.parent), "--case", "eagle-overrun 0.2 block", "--seed", "3",
                        "--fault", "eagle-overrun", "--before", "5,40", "--after", "16,93"]) == 0  # fmt: skip
    rec = json.loads((run.parent / "record.json").read_text())
    assert (rec["case"], rec["seed"], rec["length"], rec["reference_ratio"]) == ("eagle-overrun 0.2 block", 3, 64, 2)
    assert (rec["status"], rec["stored_status"], rec["caught_by"], rec["needed"]) == ("PASS", "PASS", [], None)
    assert (rec["fired"], rec["skipped"], rec["run"]) == (11, 53, run.name)
    assert rec["thresholds"] == {"ks": [1, 2, 3, 4]}  # each of the thresholds the exceedance test chooses among


def test_thresholds_count_finite_treatment_deviations_beyond_each_reference_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deviations = {
        Arm.TREATMENT: [0.9, 0.5, 0.35, 0.1, math.inf],  # the confident flip is the count test's, not counted here
        Arm.REFERENCE: [0.6, 0.4, 0.3, 0.2, 0.1, 0.05],
    }
    monkeypatch.setattr(digest, "compared_positions", lambda history, grading: 4)
    monkeypatch.setattr(
        digest,
        "samples",
        lambda history, arm, *rest: [Sample(i, "turn2", d, True) for i, d in enumerate(deviations[arm])],
    )
    again = SimpleNamespace(history=None, config=SimpleNamespace(grading=SimpleNamespace(hard_margin=1.0)))
    row = digest.thresholds(again, [1, 2, 3, 4])  # type: ignore[arg-type]
    assert (row["n_t"], row["n_r"]) == (4, 6)
    assert [row[f"m{k}"] for k in (1, 2, 3, 4)] == [1, 2, 3, 3]
    assert row["p1"] == pytest.approx(math.comb(4, 1) / math.comb(10, 1))
    # 3 of 4 beyond the 4th largest of 6: the shuffled labels put at least 3 treatment values before the 4th
    # reference one; counted over all C(10, 4) placements of the treatment's values
    placements = list(itertools.combinations(range(10), 4))
    assert row["p4"] == pytest.approx(sum(_before_kth(c, 4) >= 3 for c in placements) / len(placements))


def _before_kth(treatment_positions: tuple[int, ...], k: int) -> int:
    """How many treatment values come before the k-th reference value, reading positions 0, 1, ... in order."""
    seen = 0
    for position in range(10):
        if position not in treatment_positions:
            seen += 1
            if seen == k:
                return sum(t < position for t in treatment_positions)
    return len(treatment_positions)


def test_a_folder_without_one_finished_run_gets_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(digest, "rejudge", lambda folder: pytest.fail("nothing to judge"))
    (tmp_path / "cut").mkdir()  # a run the call's deadline interrupted: no verdict.json
    assert digest.main(["record", str(tmp_path), "--case", "x", "--seed", "0"]) == 2
    assert "no single finished run" in capsys.readouterr().err
    assert not (tmp_path / "record.json").exists()


def test_a_load_record_carries_the_pressure_the_p_values_and_the_fires(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "load-recycled140-s1" / "20261205-081500-s1"
    run.mkdir(parents=True)
    trigger = {"prefixes": 32, "decode_region_hits": 20, "needed": 16, "preemptions": 7.0, "evictions": 1200.0,
               "scheduling": "async scheduling on"}  # fmt: skip
    findings = [
        {"check": "load-trigger", "status": "PASS", "reason": "20 of 32 follow-ups resumed", "figures": trigger},
        {"check": "load", "status": "FAIL", "figures": {"n_subject": 20, "n_yardstick": 44, "p_values": [1e-9]}},
    ]
    stored = {"status": "FAIL", "error_class": "CorruptionDetected", "elapsed_s": 250.5, "findings": findings}
    (run / "verdict.json").write_text(json.dumps(stored))
    settings = {"async_scheduling": "True", "block_size": "288", "num_gpu_blocks_override": "140", "other": "x"}
    (run / "servers.json").write_text(json.dumps({"treatment": {"version": "0.26.0", "settings": settings}}))
    monkeypatch.setattr(digest, "rejudge", lambda folder: (_ for _ in ()).throw(RuntimeError("no exchanges")))

    assert digest.main(["load", str(run.parent), "--case", "recycled-block load", "--seed", "1",
                        "--fault", "recycled-block", "--before", "28,0", "--after", "61,2"]) == 0  # fmt: skip
    rec = json.loads((run.parent / "record.json").read_text())
    assert (rec["status"], rec["error_class"], rec["wall_s"]) == ("FAIL", "CorruptionDetected", 250.5)
    assert rec["probe"] == "load"
    assert (rec["trigger"]["preemptions"], rec["trigger"]["evictions"]) == (7.0, 1200.0)
    assert rec["trigger"]["status"] == "PASS"
    assert rec["load"] == {"status": "FAIL", "n_subject": 20, "n_yardstick": 44, "p_values": [1e-9]}
    assert rec["treatment_settings"]["num_gpu_blocks_override"] == "140"
    assert "other" not in rec["treatment_settings"]
    assert (rec["fired"], rec["skipped"]) == (33, 2)
    assert rec["rejudge_error"] == "RuntimeError: no exchanges"  # the stored verdict stands
    printed = json.loads(capsys.readouterr().out)  # the line plan.sh's `load` step shows
    assert printed["load"]["p_values"] == [1e-9] and printed["trigger"]["preemptions"] == 7.0


def test_a_preemption_record_reads_the_preemption_probes_own_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "load-pre-clean64-s0" / "20261207-010000-s0"
    run.mkdir(parents=True)
    findings = [
        # a load-trigger finding in the same folder must not be read as this probe's pressure
        {"check": "load-trigger", "status": "PASS", "figures": {"preemptions": 999.0}},
        {
            "check": "preempt-trigger",
            "status": "PASS",
            "figures": {
                "preemptions": 12.0,
                "reference_preemptions": 30.0,
                "recompute_preemptions": {"treatment": 0.0},
            },
        },
        {"check": "preemption", "status": "PASS", "figures": {"n_subject": 32, "n_yardstick": 64, "p_values": [0.4]}},
    ]
    (run / "verdict.json").write_text(json.dumps({"status": "PASS", "findings": findings}))
    monkeypatch.setattr(digest, "rejudge", lambda folder: (_ for _ in ()).throw(RuntimeError("no exchanges")))

    assert digest.main(["load", str(run.parent), "--case", "clean preemption", "--seed", "0",
                        "--probe", "preemption"]) == 0  # fmt: skip
    rec = json.loads((run.parent / "record.json").read_text())
    assert rec["probe"] == "preemption" and "load" not in rec
    assert (rec["trigger"]["preemptions"], rec["trigger"]["reference_preemptions"]) == (12.0, 30.0)
    assert rec["preemption"] == {"status": "PASS", "n_subject": 32, "n_yardstick": 64, "p_values": [0.4]}
    assert json.loads(capsys.readouterr().out)["preemption"]["p_values"] == [0.4]
