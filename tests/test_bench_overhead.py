"""bench/overhead.py against servers it did not start: the URL arguments, the row's `servers` and the table's
column for it (rows from before the key read as the CPU trio)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_env import bench_module

overhead = bench_module("overhead")

URLS = [
    "--treatment",
    "http://127.0.0.1:8140",
    "--control",
    "http://localhost:8141/",
    "--reference",
    "http://[::1]:8142",
]


def row(seed: int, ratio: float, **extra: Any) -> dict[str, Any]:
    return {
        "date": "2026-12-06",
        "seed": seed,
        "conversations": 32,
        "requests": 515,
        "status": "PASS",
        "cold_blackbox_wall_s": 110.0,
        "blackbox_wall_s": 100.0,
        "conversation_phase_s": 98.0,
        "replay_wall_s": 100.0 / ratio,
        "replay_before_wall_s": 90.0,
        "ratio": ratio,
        "phase_ratio": ratio - 0.02,
        "idle_fraction": {"treatment": 0.11, "control": 0.85, "reference": 0.24},
        "replay_idle_fraction": {"treatment": 0.13, "control": 0.84, "reference": 0.1},
        "client_cpu_s": 11.0,
        "replay_client_cpu_s": 4.0,
        **extra,
    }


def test_no_urls_starts_the_cpu_trio_as_before() -> None:
    args = overhead.parse_args(["--seeds", "2"])
    assert args.urls is None
    assert overhead.servers_label(None, False, "NVIDIA H100 80GB HBM3") == "cpu trio"  # the CPU trio uses no GPU


def test_all_three_loopback_urls_are_taken_as_given() -> None:
    args = overhead.parse_args([*URLS, "--label", "gpu-tiny"])
    assert args.urls == {
        "treatment": "http://127.0.0.1:8140",
        "control": "http://localhost:8141",
        "reference": "http://[::1]:8142",
    }
    assert overhead.servers_label(args.label, True, "NVIDIA H100 80GB HBM3") == "gpu-tiny on NVIDIA H100 80GB HBM3"
    assert overhead.servers_label(None, True, None) == "given servers"


@pytest.mark.parametrize(
    "argv",
    [
        URLS[:4],  # no reference
        ["--treatment", "http://127.0.0.1:8140"],
        [*URLS[:4], "--reference", "http://10.0.0.5:8142"],  # not this machine
        [*URLS[:4], "--reference", "http://example.com:8142"],
        [*URLS[:4], "--reference", "http://127.0.0.1"],  # no port
        [*URLS[:4], "--reference", "127.0.0.1:8142"],  # no scheme
        ["--label", "gpu-tiny"],  # a label for servers the script starts itself
    ],
)
def test_partial_or_remote_servers_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        overhead.parse_args(argv)
    assert exc.value.code == 2


def test_given_servers_start_no_fleet_and_each_row_says_what_it_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runs = tmp_path / "overhead.jsonl"
    runs.write_text(json.dumps(row(514, 1.182)) + "\n")  # an old CPU row, without the key
    monkeypatch.setattr(overhead, "RUNS_FILE", runs)
    monkeypatch.setattr(overhead, "TABLE_FILE", tmp_path / "overhead.md")
    monkeypatch.setattr(overhead, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")

    def no_fleet(*a: Any) -> None:
        raise AssertionError("a fleet was started for given servers")

    monkeypatch.setattr(overhead.faults, "fleet_for", no_fleet)
    measured: list[tuple[int, dict[str, str]]] = []

    def one(case: Any, urls: dict[str, str], seed: int, args: Any) -> dict[str, Any]:
        measured.append((seed, dict(urls)))
        return row(seed, 1.05)

    monkeypatch.setattr(overhead, "one", one)
    argv = [*URLS, "--label", "gpu-tiny", "--seeds", "2", "--seed-start", "600", "--commit", "abc1234"]
    argv += ["--keep-runs", str(tmp_path / "runs")]
    assert overhead.main(argv) == 0

    assert [seed for seed, _ in measured] == [600, 601]
    assert all(urls["reference"] == "http://[::1]:8142" for _, urls in measured)
    rows = [json.loads(line) for line in runs.read_text().splitlines()]
    gpu = "gpu-tiny on NVIDIA H100 80GB HBM3"
    assert [r.get("servers") for r in rows] == [None, gpu, gpu]
    assert rows[1]["commit"] == "abc1234"
    text = (tmp_path / "overhead.md").read_text()
    assert "| 2026-12-06 | cpu trio | 514 |" in text
    assert f"| {rows[1]['date']} | gpu-tiny on NVIDIA H100 80GB HBM3 | 600 |" in text  # dated when measured


def test_the_table_has_a_servers_column_and_a_mean_per_servers() -> None:
    text = overhead.table([row(513, 1.2), row(514, 1.1), row(600, 1.01, servers="gpu-tiny on NVIDIA H100")])
    assert "(CPU trio)" not in text.splitlines()[0]
    header = next(line for line in text.splitlines() if line.startswith("| date"))
    rule = next(line for line in text.splitlines() if line.startswith("|---"))
    assert header.split(" | ")[1] == "servers"
    assert header.count("|") == rule.count("|")
    lines = [line for line in text.splitlines() if line.startswith("| 2026")]
    assert [line.split(" | ")[1] for line in lines] == ["cpu trio", "cpu trio", "gpu-tiny on NVIDIA H100"]
    assert all(line.count("|") == header.count("|") for line in lines)
    assert "cpu trio: mean ratio 1.150" in text
    assert "gpu-tiny on NVIDIA H100: mean ratio 1.010" in text


def test_rebuild_table_measures_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runs = tmp_path / "overhead.jsonl"
    runs.write_text(json.dumps(row(600, 1.04, servers="gpu-tiny on NVIDIA H100")) + "\n")
    monkeypatch.setattr(overhead, "RUNS_FILE", runs)
    monkeypatch.setattr(overhead, "TABLE_FILE", tmp_path / "overhead.md")
    monkeypatch.setattr(overhead, "measure", lambda args: pytest.fail("--rebuild-table measured"))
    assert overhead.main(["--rebuild-table"]) == 0
    assert "| gpu-tiny on NVIDIA H100 | 600 |" in (tmp_path / "overhead.md").read_text()


def test_the_replay_sends_again_a_request_whose_connection_broke() -> None:
    import asyncio

    import httpx

    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content)["cache_salt"])
        if len(calls) == 1:  # a keep-alive connection the server closed
            raise httpx.ReadError("closed", request=request)
        return httpx.Response(200, json={"choices": []})

    exchanges = [
        {"conversation": 0, "arm": "treatment", "kind": "turn1", "started_s": 0.0, "request": {"cache_salt": "a"}},
        {"conversation": 0, "arm": "control", "kind": "turn1", "started_s": 0.1, "request": {"cache_salt": "b"}},
    ]
    urls = {"treatment": "http://127.0.0.1:1", "control": "http://127.0.0.1:2"}
    timings: list[dict[str, Any]] = []
    retries: list[str] = []
    asyncio.run(overhead.replay(exchanges, urls, 8, "s", timings, retries, httpx.MockTransport(handler)))
    assert calls == ["s-a", "s-a", "s-b"]
    assert retries == ["treatment"]
    assert [t["arm"] for t in timings] == ["treatment", "control"]

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("closed", request=request)

    with pytest.raises(httpx.ReadError):  # a server that stays gone still ends the replay
        asyncio.run(overhead.replay(exchanges, urls, 8, "s", [], [], httpx.MockTransport(broken)))
