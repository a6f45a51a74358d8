"""RED before GREEN for the probes issue 23 added, on the CPU pair: each passes on the clean treatment and catches
the fault made for it (that the other probes miss it is measured in bench/results/new-probes.md, not here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from servers.launch import Fleet
from servers.profiles import build_specs
from servers.vllm_plugin.faults import fired_counts, in_missed_offsets

from engine_env import BASE_PORT, CACHE, blackbox_cli

pytestmark = pytest.mark.engine  # every test here starts real servers (the load test its own pair, not cpu_fleet)

TREATMENT_PORT = BASE_PORT + 7  # the session's servers use BASE_PORT..BASE_PORT+2, the fault tests +5, +15, +17
LOAD_PORT = BASE_PORT + 20  # the small-cache pair: treatment +20, reference +22


def _run(out: Path, treatment: str, shared: Fleet, probe: str, seed: int, *extra: str) -> tuple[int, dict, str]:
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
        "--seed",
        str(seed),
        *extra,
    )
    return code, verdict, output


def _against_fault(tmp_path: Path, shared: Fleet, fault: str, probe: str, *extra: str) -> tuple[int, dict, str, int]:
    """The probe against a cpu-tiny treatment with `fault` (the shared fleet's control and reference); its fires."""
    specs = build_specs("cpu-tiny", ("treatment",), base_port=TREATMENT_PORT, cache_dir=CACHE, fault=fault)
    with Fleet(specs, tmp_path / "servers") as fleet:
        fleet.start()
        code, verdict, output = _run(tmp_path / "runs", fleet.urls["treatment"], shared, probe, 31, *extra)
        fired = fired_counts(fleet.log_path("treatment").read_text(errors="replace")).get(fault, 0)
    assert fired > 0, f"{fault} never fired, so this run says nothing\n{output}"
    return code, verdict, output, fired


def _finding(verdict: dict, check: str) -> dict:
    return next(f for f in verdict["findings"] if f["check"] == check)


GRADER = {"hit-geometry": "sweep-exactness", "held-prefix": "held-prefix", "short-follow-up": "short-follow-up"}


@pytest.mark.parametrize("probe", list(GRADER))
def test_a_new_probe_passes_on_the_clean_treatment(probe: str, cpu_fleet: Fleet, tmp_path: Path) -> None:
    code, verdict, output = _run(tmp_path / "runs", cpu_fleet.urls["treatment"], cpu_fleet, probe, 31)
    assert (code, verdict["status"]) == (0, "PASS"), output
    assert "would have been detected with probability 0.95" in _finding(verdict, GRADER[probe])["reason"], output


def test_the_sweep_names_the_offsets_a_silent_miss_leaves_unhit(cpu_fleet: Fleet, tmp_path: Path) -> None:
    """offset-miss takes every hit of a prompt ending 1/4 to 3/8 of a block past a boundary: the sweep says
    which offsets (UNKNOWN CacheNotLive, never FAIL: no answer is wrong). The multi-turn probe, whose prompts
    end elsewhere, is blind to it (bench/results/new-probes.md; a 10-minute run, so not repeated here)."""
    code, verdict, output, _ = _against_fault(tmp_path, cpu_fleet, "offset-miss", "hit-geometry")
    assert (code, verdict["status"], verdict["error_class"]) == (2, "UNKNOWN", "CacheNotLive"), output
    figures = _finding(verdict, "hit-geometry")["figures"]
    block, dead = figures["block_size"], figures["offsets_dead"]
    assert dead, output
    assert all(in_missed_offsets(o, block) for o in dead), figures
    assert not any(in_missed_offsets(o, block) for o in figures["offsets_hitting"]), figures
    assert f"repeats of prompts ending {dead} tokens past a block boundary hit nothing" in verdict["reason"]


def test_held_prefix_catches_resumes_of_a_prefix_another_request_holds(cpu_fleet: Fleet, tmp_path: Path) -> None:
    """concurrent-resume is wrong only where several requests resume from one cached prefix at once, which the
    held-prefix probe does and the multi-turn probe never does (bench/results/new-probes.md: 0 candidates).

    Whether a resume is a candidate depends on scheduling (which resumes share a step, which boundaries the drafter
    checkpointed), so the share of blocks it corrupts varies from run to run: 7 of 16 in an idle run of this seed,
    fewer in CI's run beside the rest of the suite, where 16 prefixes (the default length) fell short (p 0.0041
    against 0.0033). 5 blocks beyond the reference's largest cross alpha/3 at either length (exact exceedance null,
    16 against 32 or 32 against 64): nearly a third of 16 blocks, a sixth of 32. The default length's detection
    rate is in bench/results/new-probes.md."""
    code, verdict, output, _ = _against_fault(
        tmp_path, cpu_fleet, "concurrent-resume", "held-prefix", "--conversations", "64"
    )
    assert (code, verdict["error_class"]) == (1, "CorruptionDetected"), output
    finding = _finding(verdict, "held-prefix")
    assert finding["status"] == "FAIL", output
    # Some resumes of a block are wrong, not all (the first to resume alone is exact): a transient fault.
    assert finding["figures"]["seen"] in ("transient", "both"), finding["figures"]


def test_short_follow_ups_catch_a_restore_wrong_only_after_a_one_or_two_token_continuation(
    cpu_fleet: Fleet, tmp_path: Path
) -> None:
    """short-continuation is wrong only for a prompt continuing a finished request's whole sequence by 1-2 tokens,
    which the short-follow-up probe sends and no other probe does (bench/results/new-probes.md: 0 candidates)."""
    code, verdict, output, _ = _against_fault(tmp_path, cpu_fleet, "short-continuation", "short-follow-up")
    assert (code, verdict["error_class"]) == (1, "CorruptionDetected"), output
    assert _finding(verdict, "short-follow-up")["status"] == "FAIL", output
    added = _finding(verdict, "short-trigger")["figures"]["added_tokens"]
    assert {tuple(sorted(a.items())) for a in added.values()} == {(("short-1", 1), ("short-2", 2), ("short-q", 8))}


def _on_pair(fleet: Fleet, out: Path, probe: str, seed: int, *extra: str) -> tuple[int, dict, str]:
    """`probe` against a small-cache pair of its own (its treatment and reference, no control)."""
    code, output, _, verdict = blackbox_cli(
        out,
        "--treatment", fleet.urls["treatment"], "--reference", fleet.urls["reference"],
        "--probe", probe, "--seed", str(seed), *extra,
    )  # fmt: skip
    return code, verdict, output


# recycled-block fires only where a follow-up's hit lands on a re-allocated block while the checkpoint a block before
# is still cached, so how often it fires depends on how the server's steps interleave with the client's follow-ups:
# 8-22 times in 32 prefixes on an idle machine (bench/results/new-probes.md), 2 in a CI-like run on a machine twice
# as slow (2026-12-07), too few for any grader. A run where it fired fewer than FIRED_ENOUGH times says nothing
# about the probe, so the next seed runs on the same servers, at most LOAD_SEEDS; never firing enough fails.
FIRED_ENOUGH = 6
LOAD_SEEDS = (31, 32, 33)


def test_the_load_probe_catches_restores_wrong_only_on_blocks_recycled_under_pressure(tmp_path: Path) -> None:
    """recycled-block is wrong only on a hit whose block had a cached block evicted from it, which happens only when
    the cache is too small for the load: the load probe against the small-cache pair (cpu-tiny-load on both arms)
    sees it; on the session's cache, which holds every probe's load, nothing is ever evicted."""
    specs = build_specs("cpu-tiny-load", ("treatment", "reference"), base_port=LOAD_PORT, cache_dir=CACHE,
                        fault="recycled-block")  # fmt: skip
    fired_by_seed: dict[int, int] = {}
    with Fleet(specs, tmp_path / "servers") as fleet:
        fleet.start()
        before = 0
        for seed in LOAD_SEEDS:
            code, verdict, output = _on_pair(fleet, tmp_path / f"runs-{seed}", "load", seed)
            total = fired_counts(fleet.log_path("treatment").read_text(errors="replace")).get("recycled-block", 0)
            fired_by_seed[seed], before = total - before, total
            if fired_by_seed[seed] >= FIRED_ENOUGH:
                break
    assert fired_by_seed[seed] >= FIRED_ENOUGH, f"recycled-block fired {fired_by_seed} times by seed\n{output}"
    trigger = _finding(verdict, "load-trigger")
    assert trigger["status"] == "PASS" and trigger["figures"]["evictions"] > 0, output
    assert "async scheduling off (vLLM's CPU backend forces it off" in trigger["reason"], output
    assert (code, verdict["error_class"]) == (1, "CorruptionDetected"), (fired_by_seed, output)
    assert _finding(verdict, "load")["status"] == "FAIL", output


def test_the_preemption_probe_preempts_both_arms_and_passes_on_a_correct_engine(tmp_path: Path) -> None:
    """On the small-cache pair (cpu-tiny-preempt: the reference with half the blocks, the same tokens) both arms are
    preempted while their turn 1s are written, no recomputation is, the follow-ups on the recomputations' salts hit,
    and a correct engine, not bit-exact under preemption, passes against a reference preempted alike. (Against
    preempted-resume the probe mostly misses on this model: bench/results/new-probes.md.)"""
    specs = build_specs("cpu-tiny-preempt", ("treatment", "reference"), base_port=LOAD_PORT, cache_dir=CACHE)
    with Fleet(specs, tmp_path / "servers") as fleet:
        fleet.start()
        code, verdict, output = _on_pair(fleet, tmp_path / "runs", "preemption", 31, "--conversations", "16")
    trigger = _finding(verdict, "preempt-trigger")
    figures = trigger["figures"]
    assert trigger["status"] == "PASS", output
    assert figures["preemptions"] > 0 and figures["reference_preemptions"] > 0, figures
    assert figures["follow_up_hits"] > 0 and not any(figures["recompute_preemptions"].values()), figures
    assert "cannot be seen over HTTP" in trigger["reason"], output
    assert (code, verdict["status"]) == (0, "PASS"), output
    assert _finding(verdict, "preemption")["figures"]["compared_positions"] == "whole answer", output
