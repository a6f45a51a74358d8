"""The run folder: what is kept, that it is kept as it happens, and that replays hold no secret."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from blackbox.errors import StorageError
from blackbox.history import Arm, Exchange, Kind
from blackbox.store import RunStore, curl_command, new_run_id

import histories as h

KEY_ENV = "BLACKBOX_API_KEY"


def answered(conversation: int, arm: str = Arm.TREATMENT, text: str = "alpha bravo") -> Exchange:
    e = h.exchange(conversation, arm, Kind.TURN2, cached=h.DECODE_HIT, text=text)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "what's the code of amber ?"}], "seed": 0}
    return dataclasses.replace(e, request=body)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[RunStore]:
    store = RunStore(tmp_path / "runs", "20250101-000000-s7")
    yield store
    store.close()


def test_each_run_gets_its_own_new_folder(tmp_path: Path, run: RunStore) -> None:
    assert run.path == tmp_path / "runs" / "20250101-000000-s7"
    assert (run.path / "exchanges.jsonl").is_file()
    with pytest.raises(FileExistsError):
        RunStore(tmp_path / "runs", "20250101-000000-s7")  # never write into an earlier run


def test_run_id_carries_the_seed() -> None:
    assert new_run_id(42).endswith("-s42")


def test_layout(tmp_path: Path, run: RunStore) -> None:
    run.write_json("config.json", {"seed": 7})
    run.write_text("command.txt", "blackbox run --seed 7\n")
    run.write_text("metrics/treatment-before.prom", "# empty\n")
    run.write_json("verdict.json", {"status": "PASS"})
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "treatment.log").write_text("started\n")
    run.copy_logs(logs)
    run.copy_logs(tmp_path / "missing")  # no launched servers: nothing to copy, no error
    files = sorted(str(p.relative_to(run.path)) for p in run.path.rglob("*") if p.is_file())
    assert files == [
        "command.txt",
        "config.json",
        "exchanges.jsonl",
        "metrics/treatment-before.prom",
        "servers/treatment.log",
        "verdict.json",
    ]
    assert json.loads((run.path / "config.json").read_text()) == {"seed": 7}


def test_record_appends_and_flushes_each_line(run: RunStore) -> None:
    path = run.path / "exchanges.jsonl"
    run.record(answered(0))
    # Read through a separate handle while the store is still open: the line is already on disk.
    assert len(path.read_text().splitlines()) == 1
    run.record(answered(1, Arm.CONTROL))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["conversation"], r["arm"]) for r in lines] == [(0, Arm.TREATMENT), (1, Arm.CONTROL)]
    assert lines[0]["cached_tokens"] == h.DECODE_HIT


def test_an_interrupted_run_keeps_what_was_recorded(tmp_path: Path) -> None:
    # A child process records two exchanges and dies without closing the store.
    script = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import histories as h
from pathlib import Path
from blackbox.store import RunStore
store = RunStore(Path({str(tmp_path)!r}), "killed")
store.record(h.exchange(0, "treatment", "turn1", cached=0))
store.record(h.exchange(0, "treatment", "turn2", cached=64))
os._exit(1)
"""
    subprocess.run([sys.executable, "-c", script], check=False, timeout=60)
    lines = (tmp_path / "killed" / "exchanges.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["turn1", "turn2"]


def test_write_json_is_atomic(run: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    target = run.write_json("verdict.json", {"status": "UNKNOWN"})

    def crash(self: Path, target: Path) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(Path, "replace", crash)
    with pytest.raises(StorageError, match=r"cannot write .*: disk gone"):  # its own class (exit 6), not a traceback
        run.write_json("verdict.json", {"status": "PASS", "figures": list(range(1000))})
    assert json.loads(target.read_text()) == {"status": "UNKNOWN"}  # the old file, whole
    monkeypatch.undo()
    run.write_json("verdict.json", {"status": "FAIL"})
    assert json.loads(target.read_text()) == {"status": "FAIL"}
    assert sorted(p.name for p in run.path.iterdir() if p.suffix == ".tmp") == []


def test_replay_scripts_reference_the_key_as_a_shell_variable(run: RunStore) -> None:
    exchanges = [answered(0), answered(0, Arm.CONTROL), answered(0, Arm.REFERENCE)]
    urls = {Arm.TREATMENT: "http://t:8000/", Arm.CONTROL: "http://c:8001"}
    written = run.write_replays(urls, exchanges, KEY_ENV)
    names = sorted(p.name for p in written)
    assert names == ["c000-control-turn2.sh", "c000-treatment-turn2.sh"]  # no URL for the reference: no script
    script = (run.path / "replay" / "c000-treatment-turn2.sh").read_text()
    assert script.startswith("#!/bin/sh\n")
    assert '"Authorization: Bearer ${BLACKBOX_API_KEY:-}"' in script
    assert "http://t:8000/v1/chat/completions" in script
    syntax = subprocess.run(["sh", "-n", str(run.path / "replay" / "c000-treatment-turn2.sh")], check=False)
    assert syntax.returncode == 0


def test_curl_command_round_trips_the_body_through_the_shell() -> None:
    e = answered(3, text="it's")
    argv = shlex.split(curl_command("http://t:8000", e, KEY_ENV))
    assert argv[:3] == ["curl", "-sS", "http://t:8000/v1/chat/completions"]
    assert json.loads(argv[argv.index("-d") + 1]) == e.request  # the quote in "what's" survives quoting
    assert "X-Blackbox-Case: c003-treatment-turn2" in argv


def test_curl_run_by_a_shell_expands_the_key_from_the_environment(tmp_path: Path) -> None:
    # Replace curl by a script that prints its arguments, then run the replay as a user would.
    fake = tmp_path / "bin" / "curl"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    command = curl_command("http://t:8000", answered(0), KEY_ENV)
    env = {"PATH": f"{fake.parent}:{os.environ['PATH']}", KEY_ENV: "sk-from-env"}
    out = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True, check=True).stdout
    assert "Authorization: Bearer sk-from-env" in out.splitlines()
