"""bench/sequential.py's split of sporadic-fault runs by how often the fault struck, on hand-built rows."""

from __future__ import annotations

from typing import Any

from engine_env import bench_module

sequential = bench_module("sequential")


def _row(case: str, status: str, fired: int, conversations: int = 24, **kw: Any) -> dict[str, Any]:
    return {
        "case": case, "detect": 0.2, "round": 8, "planned_pass_look": 3, "status": status, "fired": fired,
        "conversations": conversations, **kw,
    }  # fmt: skip


def test_runs_split_at_the_share_the_pass_promises() -> None:
    case = "stale-checkpoint 0.34 block resumes 3"  # 3 resumes a conversation: 72 resumes in 24 conversations
    rows = [
        _row(case, "FAIL", 15),  # 15/72 = 0.21: at or above 0.2
        _row(case, "PASS", 14),  # 0.19: below, so this PASS broke no promise
        _row(case, "FAIL", 5, conversations=8),  # 5/24 = 0.21
        _row(case, "FAIL", 10),  # 0.14: caught although below
        _row("clean resumes 3", "PASS", 0),  # no fault: not a row of this table
        _row(case, "PASS", 20, planned_pass_look=None),  # before the plan: its own schedule, left out
    ]
    lines = sequential.struck(rows)
    body = [line for line in lines if line.startswith(f"| {case} ")]
    assert body == [f"| {case} | 0.2 | 2 / 2 | 1 / 2 | 0.19 |"]
    assert not any(line.startswith("| clean") for line in lines)


def test_fired_shows_candidates_only_where_recorded() -> None:
    assert sequential._fired({"fired": 7, "skipped": 13}) == "7/20"
    assert sequential._fired({"fired": 7}) == "7"
