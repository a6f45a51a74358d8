"""A sporadic fault on the real engine fires on about the fraction asked, and a poisoned block stays poisoned."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from scipy.stats import binomtest

from servers.launch import Fleet
from servers.profiles import build_specs
from servers.vllm_plugin import faults
from servers.vllm_plugin.faults import fault_events

from engine_env import BASE_PORT, CACHE, blackbox_cli

pytestmark = pytest.mark.engine

PORT = BASE_PORT + 10  # clear of the session fleet (BASE_PORT..+2) and the fault tests' treatment (+5)
FRACTION = 0.5


def test_sporadic_block_fault_fires_on_about_the_fraction_of_blocks(tmp_path: Path) -> None:
    specs = build_specs("cpu-tiny", ("treatment", "control"), base_port=PORT, cache_dir=CACHE, fault="stale-checkpoint")
    sporadic = {faults.SPORADIC_ENV: str(FRACTION), faults.SHAPE_ENV: "block", faults.SEED_ENV: "3"}
    specs = [dataclasses.replace(s, env={**s.env, **sporadic}) if s.role == "treatment" else s for s in specs]
    with Fleet(specs, tmp_path / "servers") as fleet:
        fleet.start()
        _, output, _, _ = blackbox_cli(
            tmp_path / "runs",
            "--treatment", fleet.urls["treatment"],
            "--control", fleet.urls["control"],
            "--conversations", "24",
            "--seed", "5",
        )  # fmt: skip
        events = fault_events(fleet.log_path("treatment").read_text(errors="replace"))
    fired = {e.block for e in events if e.fired}
    skipped = {e.block for e in events if not e.fired}
    blocks = len(fired | skipped)
    print(f"sporadic {FRACTION} block: {len(fired)} of {blocks} candidate blocks poisoned")  # seen with -s
    assert blocks >= 10, f"only {blocks} candidate blocks: the workload barely reached the fault\n{output}"
    assert not fired & skipped, "a poisoned block must be wrong for every request that resumes from it"
    # Exact two-sided binomial test of the share of poisoned blocks against the knob (α = 0.001: the draw is
    # a fixed hash, so this guards against a knob that is ignored or inverted, not against bad luck).
    assert binomtest(len(fired), blocks, FRACTION).pvalue > 0.001, (len(fired), blocks)
