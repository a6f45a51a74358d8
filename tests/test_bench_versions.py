"""bench/versions.py's server layout: which servers each probe gets on a release (no server is started here)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, ClassVar

import pytest

from servers import profiles

from engine_env import bench_module

versions = bench_module("versions")


class Started(Exception):
    """Raised by the recording fleet's start, so no probe runs."""


class RecordingFleet:
    """Keeps the specs each fleet was made with; `start` stops the caller when `stop_on_start` is set."""

    made: ClassVar[list[list[Any]]] = []
    stop_on_start: ClassVar[bool] = False

    def __init__(self, specs: list[Any], log_dir: Path) -> None:
        self.specs = list(specs)
        self.urls = {s.role: f"http://127.0.0.1:{s.port}" for s in self.specs}
        RecordingFleet.made.append(self.specs)

    def __enter__(self) -> RecordingFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def start(self) -> None:
        if RecordingFleet.stop_on_start:
            raise Started


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> type[RecordingFleet]:
    RecordingFleet.made = []
    RecordingFleet.stop_on_start = False
    monkeypatch.setattr(versions, "Fleet", RecordingFleet)
    monkeypatch.setattr(versions, "ensure_venv", lambda version, root, log: tmp_path / "venv" / "bin" / "python")
    real = versions.build_specs
    monkeypatch.setattr(versions, "build_specs", lambda *a, **kw: real(*a, model="/m/tiny", **kw))
    monkeypatch.setattr(profiles, "_usable_cores", lambda: [0, 1])
    return RecordingFleet


def _args(tmp_path: Path, probes: list[str]) -> argparse.Namespace:
    return argparse.Namespace(
        probes=probes, base_port=8700, cache_dir=tmp_path, seeds=[0], conversations=32, venvs=tmp_path / "venvs"
    )


def test_load_alone_starts_no_shared_pair(fleet: type[RecordingFleet], tmp_path: Path, monkeypatch: Any) -> None:
    probed: list[str] = []

    def run_probe(version: str, probe: str, *rest: object) -> tuple[list[Any], str]:
        probed.append(probe)
        return [], ""

    monkeypatch.setattr(versions, "run_probe", run_probe)
    versions.run_version("0.32.0", _args(tmp_path, ["load"]), tmp_path / "out")
    assert fleet.made == [[]] and probed == ["load"]

    fleet.made = []
    versions.run_version("0.32.0", _args(tmp_path, ["held-prefix", "load"]), tmp_path / "out2")
    assert [s.role for s in fleet.made[0]] == ["control", "reference"]
    assert {s.port for s in fleet.made[0]} == {8701, 8702}


def test_load_gets_a_small_cache_triple_above_the_shared_ports(fleet: type[RecordingFleet], tmp_path: Path) -> None:
    fleet.stop_on_start = True
    shared = RecordingFleet([], tmp_path)
    with pytest.raises(Started):
        versions.run_probe("0.32.0", "load", shared, _args(tmp_path, ["load"]), tmp_path / "load", tmp_path / "py")
    specs = fleet.made[-1]
    assert [s.role for s in specs] == ["treatment", "control", "reference"]
    assert all(s.port > 8702 for s in specs)
    for s in specs:  # every arm on the small cache, served by the release's venv
        assert "--num-gpu-blocks-override" in s.argv
        assert s.argv[0] == str(tmp_path / "py")

    with pytest.raises(Started):
        versions.run_probe("0.32.0", "held-prefix", shared, _args(tmp_path, ["held-prefix"]), tmp_path / "h", tmp_path)
    held = fleet.made[-1]
    assert [s.role for s in held] == ["treatment"] and held[0].port == 8700
    assert "--num-gpu-blocks-override" not in held[0].argv
