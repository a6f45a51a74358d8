"""The pytest front end: URLs from options or the environment, one item per probe, failures that say what to do
next and reach --junitxml, and a missing endpoint that errors instead of skipping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from blackbox import errors
from blackbox.engine import RunResult
from blackbox.pytest_plugin import ENV, BlackboxOutcome
from blackbox.server_info import ServerInfo
from blackbox.verdict import Finding, merge
from servers.launch import Fleet

from engine_env import BASE_PORT

SMOKE = "def test_no_corruption(blackbox_result):\n    blackbox_result.assert_pass()\n"
# Nothing listens here (the top of this suite's port range): every request is refused at once.
DEAD_URL = f"http://127.0.0.1:{BASE_PORT + 29}"


def run_pytest(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    (tmp_path / "test_smoke.py").write_text(SMOKE)
    clean = {k: v for k, v in os.environ.items() if k not in ENV.values()}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", str(tmp_path / "test_smoke.py"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**clean, **(env or {})},
        timeout=900,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


def junit_cases(path: Path) -> dict[str, ET.Element]:
    return {case.attrib["name"]: case for case in ET.parse(path).getroot().iter("testcase")}


def properties(case: ET.Element) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in case.iter("property"):
        out.setdefault(p.attrib["name"], []).append(p.attrib["value"])
    return out


def test_missing_endpoints_error_instead_of_skipping(tmp_path: Path) -> None:
    code, output = run_pytest(tmp_path)
    assert code != 0, output
    assert "blackbox needs --blackbox-treatment URL (or BLACKBOX_TREATMENT)" in output
    assert "skipped" not in output and " passed" not in output


def test_env_urls_give_one_item_per_probe_and_an_unreachable_server_errors_with_its_run_folder(
    tmp_path: Path,
) -> None:
    env = {"BLACKBOX_TREATMENT": DEAD_URL, "BLACKBOX_CONTROL": DEAD_URL, "BLACKBOX_PROBES": "multiturn,cold-race"}
    junit = tmp_path / "junit.xml"
    code, output = run_pytest(tmp_path, f"--junitxml={junit}", "--blackbox-out", str(tmp_path / "runs"), env=env)
    assert code == 1, output
    assert "2 errors" in output and "skipped" not in output, output
    cases = junit_cases(junit)
    assert set(cases) == {"test_no_corruption[multiturn]", "test_no_corruption[cold-race]"}
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2  # one run folder per probe
    for name, case in cases.items():
        (error,) = case.iter("error")
        props = properties(case)
        assert props["blackbox_status"] == ["ERROR"] and props["blackbox_error_class"] == ["EndpointError"], props
        assert props["blackbox_probe"] == [name.split("[")[1].rstrip("]")]
        run = Path(props["blackbox_run_folder"][0])
        assert run in runs and json.loads((run / "verdict.json").read_text())["status"] == "ERROR"
        assert props["blackbox_treatment_vllm_version"] == props["blackbox_control_vllm_version"] == ["unknown"]
        text = (error.text or "") + error.attrib.get("message", "")
        assert "blackbox ERROR (EndpointError)" in text and f"run folder: {run}" in text, text
        assert "re-judge" not in text  # nothing was recorded to re-judge


def test_an_option_outranks_its_environment_variable(tmp_path: Path) -> None:
    env = {"BLACKBOX_TREATMENT": "not-a-url", "BLACKBOX_CONTROL": DEAD_URL, "BLACKBOX_PROBES": "cold-race"}
    code, output = run_pytest(tmp_path, "--collect-only", "-q", "--blackbox-probe", "multiturn", env=env)
    assert code == 0, output
    assert "test_no_corruption[multiturn]" in output and "cold-race" not in output
    # The bad environment URL is reported as a usage error, not skipped.
    code, output = run_pytest(tmp_path, env=env)
    assert code != 0 and "--treatment must be an http(s) URL" in output, output
    assert "skipped" not in output


def outcome(
    tmp_path: Path, error: errors.BlackboxError, servers: dict[str, ServerInfo] | None = None
) -> BlackboxOutcome:
    run = tmp_path / "runs" / "20261201-000000-s0"
    (run / "replay").mkdir(parents=True)
    for name in ("config.json", "geometry.json", "exchanges.jsonl"):
        (run / name).write_text("{}\n")
    for case in ("c003-treatment-turn2", "c003-treatment-probe", "c003-control-turn2", "c007-treatment-turn2"):
        (run / "replay" / f"{case}.sh").write_text("#!/bin/sh\ncurl ...\n")
    verdict = merge([Finding.passed("cache-live", "hits moved"), Finding.from_error("exactness", error, checked=12)])
    return BlackboxOutcome(RunResult(verdict, None, None, run, 12.0), "multiturn", servers or {})


def test_a_failure_report_has_class_evidence_run_folder_and_replay(tmp_path: Path) -> None:
    result = outcome(tmp_path, errors.CorruptionDetected("3 of 12 prefill-region hits differ from recomputation"))
    report = result.report()
    run = result.result.store_path
    assert report.startswith("blackbox FAIL (CorruptionDetected) [multiturn]")
    assert "exactness [FAIL CorruptionDetected]: 3 of 12 prefill-region hits differ" in report
    assert "cache-live" not in report.split("\n\n")[0]  # passing checks are not evidence
    assert f"run folder: {run}" in report
    assert f"replay: sh {run / 'replay' / 'c003-control-turn2.sh'}" in report
    assert "... 1 more in" in report
    assert f"re-judge: blackbox grade {run}" in report
    props = dict(result.properties())
    assert props["blackbox_status"] == "FAIL" and props["blackbox_exit_code"] == 1
    assert props["blackbox_run_folder"] == str(run)
    assert "report:" not in report and "blackbox_report" not in props  # none written in this folder
    (run / "report.html").write_text("<!DOCTYPE html>\n")
    assert f"report: {run / 'report.html'}" in result.report()
    assert dict(result.properties())["blackbox_report"] == str(run / "report.html")


def test_a_trigger_not_exercised_report_names_the_flag_the_server_release_lacks(tmp_path: Path) -> None:
    old = ServerInfo("http://127.0.0.1:8400", "0.28.0", {"block_size": "128", "mamba_cache_mode": "align"})
    # The control runs without prefix caching by design: its settings are no hint.
    control = ServerInfo("http://127.0.0.1:8401", "0.28.0", {"block_size": "128", "enable_prefix_caching": "False"})
    error = errors.TriggerNotExercised("0/32 turn-2 hits reached decode-written blocks")
    report = outcome(tmp_path, error, {"treatment": old, "control": control}).report()
    assert "blackbox UNKNOWN (TriggerNotExercised)" in report
    assert (
        "treatment http://127.0.0.1:8400 (vLLM 0.28.0): vLLM 0.28.0 has no --prefix-cache-retention-interval" in report
    )
    assert "8401" not in report and "prefix caching is off" not in report


def test_the_plugin_runs_each_probe_against_the_cpu_pair(cpu_fleet: Fleet, tmp_path: Path) -> None:
    """The plugin's end-to-end run on the real engine: multiturn passes; the cold race against a treatment with the
    default step budget cannot fragment a prefill, so it fails as UNKNOWN (TriggerNotExercised), with its run
    folder, replay and the server's release."""
    junit = tmp_path / "junit.xml"
    # A reference, and enough conversations for the logprob grader to have power: without them the verdict rule
    # makes multiturn UNKNOWN (no grader of decode-written blocks), never PASS.
    env = {
        "BLACKBOX_TREATMENT": cpu_fleet.urls["treatment"],
        "BLACKBOX_CONTROL": cpu_fleet.urls["control"],
        "BLACKBOX_REFERENCE": cpu_fleet.urls["reference"],
    }
    code, output = run_pytest(
        tmp_path,
        f"--junitxml={junit}",
        "--blackbox-conversations=12",
        "--blackbox-seed=15",
        f"--blackbox-out={tmp_path / 'runs'}",
        "--blackbox-probe=multiturn",
        "--blackbox-probe=cold-race",
        env=env,
    )
    assert code == 1, output
    assert "1 failed, 1 passed" in output, output
    cases = junit_cases(junit)
    passed, failed = cases["test_no_corruption[multiturn]"], cases["test_no_corruption[cold-race]"]
    assert not list(passed.iter("failure")) and properties(passed)["blackbox_status"] == ["PASS"]
    (failure,) = failed.iter("failure")
    props = properties(failed)
    assert props["blackbox_status"] == ["UNKNOWN"] and props["blackbox_error_class"] == ["TriggerNotExercised"]
    assert props["blackbox_treatment_vllm_version"][0].startswith("0.32")
    text = failure.text or ""
    run = Path(props["blackbox_run_folder"][0])
    assert "blackbox UNKNOWN (TriggerNotExercised) [cold-race]" in text
    assert "prefix caching is off" not in text  # the control's settings are never blamed
    assert f"run folder: {run}" in text and "replay: sh " in text, text
    assert f"re-judge: blackbox grade {run}" in text
    assert (run / "verdict.json").is_file()


def test_detect_sends_the_multiturn_item_in_rounds_and_leaves_the_other_probes_fixed(tmp_path: Path) -> None:
    env = {"BLACKBOX_TREATMENT": DEAD_URL, "BLACKBOX_CONTROL": DEAD_URL, "BLACKBOX_DETECT": "0.2"}
    junit = tmp_path / "junit.xml"
    code, output = run_pytest(
        tmp_path,
        f"--junitxml={junit}",
        f"--blackbox-out={tmp_path / 'runs'}",
        "--blackbox-probe=multiturn",
        "--blackbox-probe=cold-race",
        "--blackbox-round=8",
        "--blackbox-max-conversations=40",
        env=env,
    )
    assert code == 1 and "2 errors" in output, output
    configs = {}
    for case in junit_cases(junit).values():
        props = properties(case)
        run = Path(props["blackbox_run_folder"][0])
        configs[props["blackbox_probe"][0]] = json.loads((run / "config.json").read_text())
    assert {k: configs["multiturn"][k] for k in ("detect", "round_conversations", "max_conversations")} == {
        "detect": 0.2,
        "round_conversations": 8,
        "max_conversations": 40,
    }
    assert configs["cold-race"]["detect"] is None


def test_a_detect_that_is_not_a_fraction_is_a_usage_error_naming_the_option(tmp_path: Path) -> None:
    env = {"BLACKBOX_TREATMENT": DEAD_URL, "BLACKBOX_CONTROL": DEAD_URL}
    code, output = run_pytest(tmp_path, "--blackbox-detect=lots", env=env)
    assert code != 0 and "detect must be a number, got 'lots'" in output, output
    code, output = run_pytest(tmp_path, env={**env, "BLACKBOX_DETECT": "1.5"})
    assert code != 0 and "--detect must be a fraction of hits between 0 and 1" in output, output
    assert "skipped" not in output and " passed" not in output


def test_resumes_reach_the_run_config_and_a_bad_count_names_the_option(tmp_path: Path) -> None:
    env = {"BLACKBOX_TREATMENT": DEAD_URL, "BLACKBOX_CONTROL": DEAD_URL, "BLACKBOX_RESUMES": "3"}
    junit = tmp_path / "junit.xml"
    code, output = run_pytest(tmp_path, f"--junitxml={junit}", f"--blackbox-out={tmp_path / 'runs'}", env=env)
    assert code == 1 and "1 error" in output, output
    (case,) = junit_cases(junit).values()
    run = Path(properties(case)["blackbox_run_folder"][0])
    assert json.loads((run / "config.json").read_text())["shape"]["resumes"] == 3
    code, output = run_pytest(tmp_path, "--blackbox-resumes=9", env=env)
    assert code != 0 and "--resumes must be between 1 and 4" in output, output
    assert "skipped" not in output and " passed" not in output
