"""A stored run folder read for people: whatever of it is there, and a note for each part that is not.

`read` never raises on a missing or malformed file (a run cut short, a folder from an older blackbox): the report
shows what it can and says what it could not, one line each.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blackbox import errors
from blackbox.config import RunConfig
from blackbox.history import History
from blackbox.store import load_history

__all__ = ["RunFolder", "read"]


@dataclass(frozen=True)
class RunFolder:
    path: Path
    verdict: Mapping[str, Any] | None  # verdict.json as stored: the run's verdict of record
    config: RunConfig | None
    history: History | None
    command: str | None
    servers: Mapping[str, Any] = field(default_factory=dict)
    retries: tuple[Mapping[str, Any], ...] = ()
    notes: tuple[str, ...] = ()  # what could not be read

    @property
    def findings(self) -> list[Mapping[str, Any]]:
        return list((self.verdict or {}).get("findings") or [])

    def finding(self, check: str) -> Mapping[str, Any] | None:
        return next((f for f in self.findings if f.get("check") == check), None)

    def figures(self, check: str) -> Mapping[str, Any]:
        found = self.finding(check)
        return (found or {}).get("figures") or {}


def read(run_dir: Path) -> RunFolder:
    notes: list[str] = []
    verdict = _json(run_dir / "verdict.json", notes)
    config_data = _json(run_dir / "config.json", notes)
    config = None
    if isinstance(config_data, dict):
        try:
            config = RunConfig.from_json(config_data)
        except (errors.BlackboxError, TypeError, ValueError) as exc:
            notes.append(f"config.json does not load ({type(exc).__name__}: {str(exc)[:120]})")
    history = None
    if (run_dir / "geometry.json").is_file() and (run_dir / "exchanges.jsonl").is_file():
        try:
            history = load_history(run_dir)[1]
        except errors.BlackboxError as exc:
            notes.append(exc.message)
    else:
        notes.append("no geometry.json or exchanges.jsonl: the run ended before it sent the workload")
    command = run_dir / "command.txt"
    servers = _json(run_dir / "servers.json", notes if history is not None else [])
    return RunFolder(
        run_dir,
        verdict if isinstance(verdict, dict) else None,
        config,
        history,
        command.read_text(encoding="utf-8").strip() if command.is_file() else None,
        servers if isinstance(servers, dict) else {},
        tuple(_jsonl(run_dir / "retries.jsonl", notes)),
        tuple(notes),
    )


def _json(path: Path, notes: list[str]) -> Any:
    if not path.is_file():
        notes.append(f"no {path.name}")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        notes.append(f"{path.name} is unreadable ({type(exc).__name__})")
        return None


def _jsonl(path: Path, notes: list[str]) -> list[Mapping[str, Any]]:
    if not path.is_file():
        return []
    out: list[Mapping[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            notes.append(f"{path.name} line {number} is malformed")
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
