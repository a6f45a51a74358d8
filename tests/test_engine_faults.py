"""RED before GREEN: each injected fault must fire in the real engine and be caught by the probe meant for it,
and the same probe on a clean treatment must pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from servers.launch import Fleet
from servers.profiles import build_specs
from servers.vllm_plugin.faults import fired_counts

from engine_env import BASE_PORT, CACHE, blackbox_cli

# fault -> (profile, probe, the checks that should catch it)
CASES = {
    "eagle-overrun": ("cpu-tiny", "multiturn", {"logprob", "exactness"}),
    "stale-checkpoint": ("cpu-tiny", "multiturn", {"logprob", "exactness"}),
    "chunk-end-as-boundary": ("cpu-tiny-fragmented", "cold-race", {"race-divergence"}),
}
TREATMENT_PORT = BASE_PORT + 5  # the session's servers use BASE_PORT..BASE_PORT+2


def _blackbox(treatment: str, shared: Fleet, probe: str, out: Path, seed: int) -> tuple[int, dict, str]:
    code, output, _, verdict = blackbox_cli(
        out,
        "--treatment",
        treatment,
        "--control",
        shared.urls["control"],
        "--reference",
        shared.urls["reference"],
        "--probe",
        probe,
        "--conversations",
        "16",
        "--seed",
        str(seed),
    )
    return code, verdict, output


def _treatment(profile: str, fault: str | None, log_dir: Path) -> Fleet:
    specs = build_specs(profile, ("treatment",), base_port=TREATMENT_PORT, cache_dir=CACHE, fault=fault)
    return Fleet(specs, log_dir)


@pytest.mark.parametrize("fault", sorted(CASES))
def test_fault_fires_and_is_caught(fault: str, cpu_fleet: Fleet, tmp_path: Path) -> None:
    profile, probe, catchers = CASES[fault]
    with _treatment(profile, fault, tmp_path / "servers") as fleet:
        fleet.start()
        code, verdict, output = _blackbox(fleet.urls["treatment"], cpu_fleet, probe, tmp_path / "runs", seed=21)
        fired = fired_counts(fleet.log_path("treatment").read_text(errors="replace")).get(fault, 0)
    assert fired > 0, f"{fault} never fired, so this run says nothing about blackbox\n{output}"
    failing = {f["check"] for f in verdict["findings"] if f["status"] == "FAIL"}
    assert code == 1, output
    assert verdict["status"] == "FAIL" and verdict["error_class"] == "CorruptionDetected", output
    assert failing & catchers, (failing, output)


def test_cold_race_passes_on_a_clean_fragmented_treatment(cpu_fleet: Fleet, tmp_path: Path) -> None:
    with _treatment("cpu-tiny-fragmented", None, tmp_path / "servers") as fleet:
        fleet.start()
        code, verdict, output = _blackbox(fleet.urls["treatment"], cpu_fleet, "cold-race", tmp_path / "runs", 21)
    checks = {f["check"]: f for f in verdict["findings"]}
    assert checks["race-trigger"]["status"] == "PASS", output  # prefills really were fragmented
    assert code == 0 and verdict["status"] == "PASS", output
