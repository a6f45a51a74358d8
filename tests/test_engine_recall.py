"""The recall grader on a real engine, through the staging smoke test's mode: the treatment alone (no control, no
reference), the tiny model trained to recall (servers/recall_model.py, built on first use), graded by recall."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servers.launch import Fleet
from servers.profiles import build_specs
from servers.recall_model import MIN_RECALL, build_recall_model
from servers.vllm_plugin.faults import fired_counts

from engine_env import BASE_PORT, CACHE, blackbox_cli

pytestmark = pytest.mark.engine

PORT = BASE_PORT + 12  # clear of the session fleet (+0..2), the fault tests' treatment (+5) and sporadic (+10..)
CONVERSATIONS = 32


def _alone(fault: str | None, tmp_path: Path, seed: int) -> tuple[int, str, Path, dict, int]:
    build_recall_model(CACHE)  # minutes the first time; then cached like the planted model
    specs = build_specs("cpu-tiny-recall", ("treatment",), base_port=PORT, cache_dir=CACHE, fault=fault)
    with Fleet(specs, tmp_path / "servers") as fleet:
        fleet.start()
        code, output, run, verdict = blackbox_cli(
            tmp_path / "runs",
            "--treatment", fleet.urls["treatment"],
            "--conversations", str(CONVERSATIONS),
            "--seed", str(seed),
        )  # fmt: skip
        fired = fired_counts(fleet.log_path("treatment").read_text(errors="replace")).get(fault or "", 0)
    return code, output, run, verdict, fired


def _recall(verdict: dict) -> dict:
    (finding,) = [f for f in verdict["findings"] if f["check"] == "recall"]
    return finding


def test_the_trained_model_recalls_so_single_endpoint_mode_passes_a_clean_treatment(tmp_path: Path) -> None:
    recorded = json.loads((build_recall_model(CACHE) / "recall.json").read_text())
    assert recorded["heldout_recall"] >= MIN_RECALL
    code, output, run, verdict, _ = _alone(None, tmp_path, seed=31)
    assert "single endpoint" in output
    assert "control" not in {json.loads(line)["arm"] for line in (run / "exchanges.jsonl").read_text().splitlines()}
    finding = _recall(verdict)
    # served by vLLM, cold (fresh cache_salt): the model recalls as it did in training
    assert finding["figures"]["no_reuse_recall"] >= MIN_RECALL, output
    assert code == 0 and verdict["status"] == "PASS" and verdict["graders_used"] == ["recall"], output
    assert "would have been detected with probability 0.95" in finding["reason"]
