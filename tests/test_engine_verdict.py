"""A clean run on the real CPU servers, through the CLI: PASS with the trigger proven, and a complete run folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from servers.launch import Fleet

from engine_env import blackbox_cli


def _run_with(fleet: Fleet, out: Path, **roles: str) -> tuple[int, str, Path]:
    args = [a for role, arm in roles.items() for a in (f"--{role}", fleet.urls[arm])]
    code, output, run, _ = blackbox_cli(out, "--treatment", fleet.urls["treatment"], *args, "--conversations", "4")
    return code, output, run


def _run(fleet: Fleet, out: Path, *extra: str) -> tuple[int, str, Path]:
    code, output, run, _ = blackbox_cli(
        out, "--treatment", fleet.urls["treatment"], "--control", fleet.urls["control"], *extra
    )
    return code, output, run


def test_clean_pair_passes_with_the_trigger_proven(cpu_fleet: Fleet, tmp_path: Path) -> None:
    code, output, run = _run(
        cpu_fleet, tmp_path, "--reference", cpu_fleet.urls["reference"], "--conversations", "16", "--seed", "11"
    )
    verdict = json.loads((run / "verdict.json").read_text())
    assert code == 0, output
    assert verdict["status"] == "PASS", output
    checks = {f["check"]: f for f in verdict["findings"]}
    trigger = checks["trigger"]["figures"]
    assert trigger["decode_region_hits"] > 16 // 2, trigger  # most conversations (~84% measured)
    assert checks["comparability"]["status"] == checks["roles"]["status"] == "PASS"
    assert checks["exactness"]["figures"]["n_subject"] >= 12
    assert set(verdict["graders_used"]) == {"exactness", "logprob"}
    assert checks["logprob"]["covers_trigger"] and not checks["exactness"]["covers_trigger"]
    assert checks["logprob"]["figures"]["alpha"] == 0.005  # one alpha, split over the two graders used
    assert "would have been detected with probability 0.95" in verdict["reason"]
    assert checks["drafter-live"]["figures"]["accepted_tokens"] > 0
    # The run folder holds what is needed to replay it.
    exchanges = (run / "exchanges.jsonl").read_text().splitlines()
    # per conversation: treatment 5, control 1, reference 5; the reference's 16 more (--reference-ratio 2, its
    # yardstick) 5 each; and one comparability request per server
    assert len(exchanges) == 16 * 11 + 16 * 5 + 3
    assert len(json.loads((run / "yardstick-plans.json").read_text())) == 16
    assert checks["logprob"]["figures"]["n_yardstick"] > checks["logprob"]["figures"]["n_subject"]
    for arm in ("treatment", "control", "reference"):
        assert (run / "metrics" / f"{arm}-before.prom").is_file()
        assert (run / "metrics" / f"{arm}-after.prom").is_file()
    assert list((run / "replay").glob("*.sh"))
    assert "blackbox: PASS" in output and "acceptance per position" in output
    # The folder alone re-judges to the same verdict, with no server.
    regrade = subprocess.run([sys.executable, "-m", "blackbox.cli", "grade", str(run)], capture_output=True, text=True)
    assert regrade.returncode == 0, regrade.stdout + regrade.stderr
    assert "blackbox: PASS" in regrade.stdout


def test_without_a_reference_no_grader_judges_decode_region_hits_so_the_run_is_unknown(
    cpu_fleet: Fleet, tmp_path: Path
) -> None:
    # This test asserted PASS before the verdict rule: with no reference and a model that cannot recall, only
    # prefill-region hits could be judged, so a treatment corrupting every decode-written block would have
    # passed. Now the run says it could not have seen that, and why.
    code, output, run = _run(cpu_fleet, tmp_path, "--conversations", "4", "--seed", "12")
    verdict = json.loads((run / "verdict.json").read_text())
    not_used = {g["grader"]: g["why"] for g in verdict["graders_not_used"]}
    assert "reference" in not_used["logprob"] and "reference" in not_used["exactness"]
    assert "recall" in not_used  # the tiny model cannot recall; auto mode says so instead of grading it
    assert verdict["graders_used"] == []
    assert code == 2 and verdict["status"] == "UNKNOWN" and verdict["error_class"] == "NoEvidence", output
    assert "--reference" in verdict["hint"]


def test_a_control_of_another_model_is_a_usage_error_before_any_conversation(cpu_fleet: Fleet, tmp_path: Path) -> None:
    # The reference serves the same weights but runs no speculative decoding: as a control it breaks the control's
    # role, and pointing the reference at the treatment is one server twice. Both are caught in seconds.
    code, output, run = _run_with(cpu_fleet, tmp_path, control="reference", reference="treatment")
    verdict = json.loads((run / "verdict.json").read_text())
    assert code == 3 and verdict["status"] == "ERROR" and verdict["error_class"] == "UsageError", output
    assert "speculative" in output and "one server" in output
    lines = (run / "exchanges.jsonl").read_text().splitlines()
    assert {json.loads(line)["kind"] for line in lines} == {"comparability"}  # nothing else was sent


def test_naming_the_recall_grader_on_a_model_that_cannot_recall_is_unknown(cpu_fleet: Fleet, tmp_path: Path) -> None:
    code, output, run = _run(cpu_fleet, tmp_path, "--conversations", "4", "--seed", "13", "--grader", "recall")
    verdict = json.loads((run / "verdict.json").read_text())
    assert code == 2, output
    assert verdict["status"] == "UNKNOWN" and verdict["error_class"] == "ControlQualityFailure"


def test_single_endpoint_mode_on_the_real_pair(cpu_fleet: Fleet, tmp_path: Path) -> None:
    # A staging smoke test has no control: the treatment's own fresh-salt answers are the control. On the tiny
    # model (which cannot recall) the treatment alone has no grader for decode-written blocks: UNKNOWN, saying why.
    code, output, run, verdict = blackbox_cli(
        tmp_path / "alone", "--treatment", cpu_fleet.urls["treatment"], "--conversations", "4", "--seed", "15"
    )
    assert code == 2 and verdict["error_class"] == "NoEvidence", output
    assert "control" not in {json.loads(line)["arm"] for line in (run / "exchanges.jsonl").read_text().splitlines()}
    assert "single endpoint" in output
    # With the reference as the yardstick, the same mode grades decode-region hits and passes a clean treatment.
    code, output, run, verdict = blackbox_cli(
        tmp_path / "with-reference",
        "--treatment",
        cpu_fleet.urls["treatment"],
        "--reference",
        cpu_fleet.urls["reference"],
        "--conversations",
        "12",
        "--seed",
        "15",
    )
    assert code == 0 and verdict["status"] == "PASS", output
    assert "logprob" in verdict["graders_used"]


def test_several_resumes_land_on_distinct_decode_written_boundaries(cpu_fleet: Fleet, tmp_path: Path) -> None:
    # --resumes 3: each conversation resumes turn 1's decode-written blocks at turn 2's boundary and at the
    # answer cut one and two blocks earlier. The reference (no drafter: every boundary checkpointed) lands each
    # a block apart; the logprob grader scores conversations by their largest deviation.
    code, output, run = _run(
        cpu_fleet,
        tmp_path,
        "--reference", cpu_fleet.urls["reference"],
        "--conversations", "8", "--seed", "13", "--resumes", "3",
    )  # fmt: skip
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["status"] == "PASS", output
    assert code == 0
    block = json.loads((run / "geometry.json").read_text())["block_size"]
    rows = [json.loads(line) for line in (run / "exchanges.jsonl").read_text().splitlines()]
    cached = {(r["conversation"], r["arm"], r["kind"]): r["cached_tokens"] for r in rows}
    apart = [
        c
        for (c, arm, kind), hit in cached.items()
        if arm == "reference" and kind == "turn2" and hit
        and cached.get((c, arm, "resume1")) == hit - block and cached.get((c, arm, "resume2")) == hit - 2 * block
    ]  # fmt: skip
    assert len(apart) >= 12, (len(apart), block, sorted(cached.items())[:30])  # of 16 reference conversations
    logprob = {f["check"]: f for f in verdict["findings"]}["logprob"]["figures"]
    assert logprob["resumes_per_conversation"] == 3, logprob
    assert logprob["n_subject"] >= 6 and logprob["n_yardstick"] >= 12, logprob
    assert "each its largest deviation over 3 decode-region resumes" in verdict["reason"]
