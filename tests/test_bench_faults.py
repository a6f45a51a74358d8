"""The fault benchmark's bookkeeping: case selection, one outcome per seed, and the stated intervals."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine_env import bench_module

bench = bench_module("faults")


def test_cases_cover_the_issue_8_targets() -> None:
    names = {c.name for c in bench.CASES}
    for fault in ("eagle-overrun", "stale-checkpoint", "chunk-end-as-boundary"):
        assert fault in names
        for fraction in ("0.2", "0.1"):
            for shape in ("block", "restore"):
                assert f"{fault} {fraction} {shape}" in names
    assert {c.name for c in bench.select("false-alarm")} == {
        "clean", "clean fragmented", "clean 1 spec token", "clean no reference", "clean cold-race",
    }  # fmt: skip
    assert {c.name for c in bench.select("alone")} == {
        "recall alone", "recall alone eagle-overrun", "recall alone stale-checkpoint",
        "clean cold-race alone", "chunk-end-as-boundary alone",
    }  # fmt: skip
    assert [c.name for c in bench.select("stale-checkpoint 0.1*,clean")] == [
        "clean", "stale-checkpoint 0.1 block", "stale-checkpoint 0.1 restore",
    ]  # fmt: skip
    assert len(bench.select("all")) == len(bench.CASES)
    with pytest.raises(ValueError, match="no case"):
        bench.select("eagle")


def test_sporadic_cases_pass_their_knob_to_the_treatment_only() -> None:
    case = next(c for c in bench.CASES if c.name == "eagle-overrun 0.1 restore")
    assert case.treatment_env() == {
        "BLACKBOX_FAULT_SPORADIC": "0.1", "BLACKBOX_FAULT_SHAPE": "restore", "BLACKBOX_FAULT_SEED": "0",
    }  # fmt: skip
    assert bench.select("clean")[0].treatment_env() == {}


def test_intervals_are_exact_clopper_pearson() -> None:
    # Zero false alarms bound the rate at 1 - 0.05^(1/n): 25.9% for 10 runs, 5.8% for 50.
    assert bench.interval(0, 10, True) == "0/10 (0%, ≤ 25.9%)"
    assert bench.interval(0, 50, True) == "0/50 (0%, ≤ 5.8%)"
    assert bench.interval(19, 20, False) == "19/20 (95%, 75%–100%)"
    assert bench.interval(0, 0, False) == "-"


def _run(seed: int, length: int, status: str, error: str | None, **extra: Any) -> dict[str, Any]:
    base = {
        "case": "stale-checkpoint 0.1 block", "seed": seed, "length": length, "status": status,
        "error_class": error, "caught_by": [], "needed": None, "fired": 2, "skipped": 18, "wall_s": 100.0,
        "command": "python bench/faults.py", "date": "2026-12-01", "commit": "abc",
    }  # fmt: skip
    return {**base, **extra}


def test_a_seed_counts_once_by_its_longest_run_and_a_redo_replaces_it(tmp_path: Path) -> None:
    runs = [
        _run(0, 32, "UNKNOWN", "InsufficientPower"),
        _run(0, 64, "FAIL", "CorruptionDetected", caught_by=["logprob"], needed=40),
        _run(1, 32, "PASS", None),
        _run(1, 32, "FAIL", "CorruptionDetected", caught_by=["exactness"], needed=12),  # --redo
    ]
    path = tmp_path / "runs.jsonl"
    for r in runs:
        bench.append_run(path, r)
    assert bench.load_runs(path) == runs
    per_case = bench.latest_per_seed(bench.load_runs(path))
    final = bench.final_runs(per_case[("stale-checkpoint 0.1 block", 1)])
    assert [(r["seed"], r["length"], r["status"]) for r in final] == [(0, 64, "FAIL"), (1, 32, "FAIL")]
    text = bench.table(runs)
    row = next(line for line in text.splitlines() if line.startswith("| stale-checkpoint 0.1 block, reference 1x |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[3] == "2"  # seeds
    assert cells[4].startswith("2/2 (100%")
    assert cells[7] == "exactness 1, logprob 1"
    assert cells[8] == "12/26/40 conv"
    assert cells[10] == "4/40 (10%)"
    assert "False alarms over every clean run: -" in text  # no clean run recorded: no figure


def test_seeds_run_at_different_lengths_are_counted_per_length() -> None:
    clean = {"case": "clean", "fired": 0, "skipped": 0, "reference_ratio": 2}
    runs = [_run(s, 32, "PASS", None, **clean) for s in range(3)] + [_run(9, 64, "PASS", None, **clean)]
    row = next(line for line in bench.table(runs).splitlines() if line.startswith("| clean, reference 2x |"))
    assert [c.strip() for c in row.split("|")[1:-1]][9] == "32 (3 seeds), 64 (1 seed) conv"
    one = next(line for line in bench.table(runs[:3]).splitlines() if line.startswith("| clean, reference 2x |"))
    assert [c.strip() for c in one.split("|")[1:-1]][9] == "32 conv"


def test_runs_at_another_reference_ratio_are_rows_of_their_own_and_the_default_has_its_own_false_alarm_figure(
    tmp_path: Path,
) -> None:
    clean = {"case": "clean", "fired": 0, "skipped": 0}
    runs = [
        _run(0, 32, "FAIL", "CorruptionDetected", **clean),  # before the option: 1x
        _run(0, 32, "PASS", None, reference_ratio=2, **clean),
        _run(1, 32, "PASS", None, reference_ratio=2, **clean),
        _run(0, 3, "PASS", None, case="clean cold-race", fired=0, skipped=0),  # no yardstick: counted as is
    ]
    assert set(bench.latest_per_seed(runs)) == {("clean", 1), ("clean", 2), ("clean cold-race", 1)}
    text = bench.table(runs)
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")][1:]  # past the header
    assert rows == ["clean, reference 2x", "clean, reference 1x", "clean cold-race"]
    assert "False alarms over every clean run: 1/4 (25%" in text
    assert "and the variants without a reference: 0/3 (0%" in text
    assert bench.run_folder(tmp_path, "clean", 0, 32, 2).name == "clean-s0-n32-r2"
    assert bench.run_folder(tmp_path, "clean", 0, 32).name == "clean-s0-n32"  # folders kept before the option


def test_an_underpowered_seed_is_extended_to_the_length_asked_within_the_cap() -> None:
    multiturn = next(c for c in bench.CASES if c.name == "stale-checkpoint 0.1 block")
    race = next(c for c in bench.CASES if c.name == "chunk-end-as-boundary 0.1 block")

    def ext(case: Any, cap: int, asked: int | None, length: int = 32, error: str = "InsufficientPower") -> int | None:
        record = _run(0, length, "UNKNOWN", error, asked=asked)
        return bench.extension(case, record, SimpleNamespace(extend_to=cap))

    assert ext(multiturn, 128, 80) == 80
    assert ext(multiturn, 64, 80) == 64  # capped
    assert ext(multiturn, 128, None) == 128  # nothing asked: the cap
    assert ext(multiturn, 128, 20) == 33  # asked for less than was run: one longer at least
    assert ext(multiturn, 0, 80) is None  # --extend-to not given
    assert ext(multiturn, 128, 80, error="NoEvidence") is None
    assert ext(multiturn, 64, 80, length=64) is None  # already at the cap
    assert ext(race, 12, 15, length=3) == 8  # 15 rounds in all: 8 per prompt size


def test_regrade_rejudges_kept_runs_of_other_commits_and_keeps_their_traffic_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from blackbox.verdict import Finding, Status, Verdict

    kept = tmp_path / "kept"
    for seed in (0, 1):  # seed 2's folder is gone
        folder = bench.run_folder(kept, "stale-checkpoint 0.1 block", seed, 32)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    path = tmp_path / "runs.jsonl"
    old = [_run(0, 32, "FAIL", "CorruptionDetected", caught_by=["exactness"]), _run(2, 32, "PASS", None)]
    for r in [*old, _run(1, 32, "PASS", None, commit="new")]:  # seed 1: judged by this commit already
        bench.append_run(path, r)
    judged: list[Path] = []
    verdict = Verdict(Status.PASS, "every gate passed", None, (Finding.passed("logprob", "fine"),), 0)
    monkeypatch.setattr(
        bench,
        "rejudge",
        lambda folder: judged.append(folder) or SimpleNamespace(verdict=verdict, history=None, config=None),
    )
    args = SimpleNamespace(runs=path, regrade=kept)
    stamp = {"command": "python bench/faults.py --regrade kept", "date": "2026-12-02", "commit": "new"}

    assert bench.regrade(args, stamp) == 1
    assert judged == [bench.run_folder(kept, "stale-checkpoint 0.1 block", 0, 32)]
    latest = {r["seed"]: r for r in bench.latest_per_seed_records(bench.load_runs(path))}
    assert (latest[0]["status"], latest[0]["caught_by"], latest[0]["commit"]) == ("PASS", [], "new")
    assert (latest[0]["ran_at"], latest[0]["fired"], latest[0]["wall_s"]) == ("abc", 2, 100.0)
    assert latest[2] == old[1]  # no folder: left as it was
    # the table still names the command that sent the traffic, beside the regrade
    sent = bench.made_by(old[0])
    assert latest[0]["sent_by"] == sent
    row = bench.case_row(bench.Case("stale-checkpoint 0.1 block", "multiturn", fault="stale-checkpoint"), [latest[0]])
    assert sent in row and "--regrade kept" in row


def test_a_case_alone_starts_and_asks_the_treatment_only(tmp_path: Path) -> None:
    (case,) = bench.select("recall alone eagle-overrun")
    args = SimpleNamespace(base_port=8900, cache_dir=tmp_path, conversations=32, race_rounds=3, reference_ratio=2)
    with pytest.MonkeyPatch.context() as mp:
        real = bench.build_specs
        mp.setattr(bench, "build_specs", lambda profile, roles, **kw: real(profile, roles, model="/m", **kw))
        mp.setattr(bench, "Fleet", lambda specs, log_dir: specs)
        (spec,) = bench.fleet_for(case, args, tmp_path)
    assert spec.role == "treatment" and "eagle-overrun" in str(spec.env)
    assert not case.has_yardstick and case.ratio(2) == 1  # no reference, so no yardstick to enlarge
    config = bench.run_config(case, {"treatment": "http://127.0.0.1:8900"}, 3, args, 32)
    assert config.control is None and config.reference is None
