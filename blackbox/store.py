"""Each run in its own folder, holding everything needed to understand and replay it.

runs/<run-id>/
  config.json           the resolved RunConfig, seed and geometry
  command.txt           the blackbox command that re-runs it
  exchanges.jsonl       every request and response, with timing and cached_tokens
  metrics/<arm>-{before,after}.prom
  verdict.json          the verdict and every finding with its figures
  summary.txt           what the console printed
  replay/<case>.sh      a curl per request of each conversation a grader flagged (no secrets)
  servers/              the server logs, when blackbox launched the servers
"""

from __future__ import annotations

import json
import shlex
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blackbox.history import Exchange

if TYPE_CHECKING:
    from blackbox.history import History
    from blackbox.verdict import Finding

__all__ = ["RunStore", "curl_command", "load_history", "load_preflight", "new_run_id"]


def new_run_id(seed: int) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime()) + f"-s{seed}"


class RunStore:
    def __init__(self, root: Path, run_id: str) -> None:
        self.path = root / run_id
        self.path.mkdir(parents=True, exist_ok=False)
        self._exchanges = (self.path / "exchanges.jsonl").open("a", encoding="utf-8")

    def write_json(self, name: str, data: Any) -> Path:
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
        tmp.replace(target)
        return target

    def write_text(self, name: str, text: str) -> Path:
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        return target

    def record(self, exchange: Exchange) -> None:
        """Append as soon as an exchange completes, so an interrupted run loses nothing already recorded."""
        self._exchanges.write(json.dumps(exchange.to_json(), default=str) + "\n")
        self._exchanges.flush()

    def write_replays(
        self, base_urls: Mapping[str, str], exchanges: Iterable[Exchange], api_key_env: str
    ) -> list[Path]:
        written = []
        for e in exchanges:
            url = base_urls.get(e.arm)
            if url:
                script = "#!/bin/sh\n" + curl_command(url, e, api_key_env) + "\n"
                written.append(self.write_text(f"replay/{e.case_id}.sh", script))
        return written

    def copy_logs(self, log_dir: Path) -> None:
        if log_dir.is_dir():
            shutil.copytree(log_dir, self.path / "servers", dirs_exist_ok=True)

    def close(self) -> None:
        self._exchanges.close()


def curl_command(base_url: str, exchange: Exchange, api_key_env: str) -> str:
    """A ready-to-paste curl; the key is referenced as a shell variable, never written out."""
    body = json.dumps(dict(exchange.request), separators=(",", ":"))
    parts = [
        "curl -sS",
        shlex.quote(f"{base_url.rstrip('/')}/v1/chat/completions"),
        "-H 'Content-Type: application/json'",
        f"-H 'X-Blackbox-Case: {exchange.case_id}'",
        f'-H "Authorization: Bearer ${{{api_key_env}:-}}"',
        "-d",
        shlex.quote(body),
    ]
    return " ".join(parts)


def load_preflight(run_dir: Path) -> list[Finding]:
    """The role and comparability findings made before the workload, so a re-grade keeps them. A run folder from
    before they were stored has none, and says so as a failed gate rather than passing without them."""
    from blackbox.errors import NoEvidence
    from blackbox.verdict import Finding

    path = run_dir / "preflight.json"
    if not path.exists():
        return [Finding.from_error("preflight", NoEvidence(f"{path} is missing: the roles were never checked"))]
    return [Finding.from_json(f) for f in json.loads(path.read_text())]


def load_history(run_dir: Path) -> tuple[dict[str, Any], History]:
    """Rebuild a run's config and History from its folder, so a run can be re-graded without the servers."""
    from blackbox.client import parse_chat
    from blackbox.history import History, Plan
    from blackbox.metrics import MetricsDelta, parse
    from blackbox.race import RaceRound

    config = json.loads((run_dir / "config.json").read_text())
    geometry = json.loads((run_dir / "geometry.json").read_text())
    plans = [
        Plan(**{**p, "turn1_messages": tuple(p["turn1_messages"]), "probe_messages": tuple(p["probe_messages"])})
        for p in (json.loads((run_dir / "plans.json").read_text()) if (run_dir / "plans.json").exists() else [])
    ]
    race_file = run_dir / "race.json"
    race = json.loads(race_file.read_text()) if race_file.exists() else {"rounds": [], "budget": None}
    exchanges = []
    for line in (run_dir / "exchanges.jsonl").read_text().splitlines():
        e = json.loads(line)
        parsed = parse_chat(e["response"]) if e.get("response") else {}
        exchanges.append(
            Exchange(
                e["conversation"],
                e["arm"],
                e["kind"],
                e["case_id"],
                elapsed_s=e["elapsed_s"],
                error=e["error"],
                request=e["request"],
                status_code=e["status_code"],
                **parsed,
            )
        )

    def delta(before: Path, after: Path) -> MetricsDelta | None:
        return MetricsDelta(parse(before.read_text()), parse(after.read_text())) if after.exists() else None

    deltas = {}
    for before in sorted((run_dir / "metrics").glob("*-before.prom")):
        arm = before.name.removesuffix("-before.prom")
        if (d := delta(before, before.with_name(f"{arm}-after.prom"))) is not None:
            deltas[arm] = d
    window = run_dir / "metrics" / "race-window"
    race_window = delta(window / "before.prom", window / "after.prom")
    rounds = tuple(RaceRound(**r) for r in race["rounds"])
    history = History(
        geometry["block_size"], tuple(plans), tuple(exchanges), deltas, rounds, race.get("budget"), race_window
    )
    return config, history
