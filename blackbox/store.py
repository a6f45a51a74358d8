"""Each run in its own folder, holding everything needed to understand and replay it.

runs/<run-id>/
  config.json           the resolved RunConfig, seed and geometry
  command.txt           the blackbox command that re-runs it
  exchanges.jsonl       every request and response, with timing and cached_tokens
  metrics/<arm>-{before,after}.prom
  metrics/<arm>-scrapes.jsonl   counters at every /metrics read during the run (restart detection)
  retries.jsonl         every retried request: server, request, attempt, reason, wait
  verdict.json          the verdict and every finding with its figures; written however the run ended
  traceback.txt         only when blackbox itself failed (InternalError): the traceback, kept off the terminal
                        (traceback-report.txt: report.html could not be written; the verdict stands)
  summary.txt           what the console printed
  report.html           the same for a browser: verdict, evidence, figures, flagged conversations (html_report)
  probes/<name>.json    what a probe recorded beyond its exchanges (History.extras), for probes that store it
  replay/<case>.sh      a curl per request of each conversation a grader flagged (no secrets)
  servers/              the server logs, when blackbox launched the servers

Everything written passes the run's `Redactor`, so the API key never lands in the folder; a write that fails
(disk full, permissions) is a `StorageError`.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blackbox.errors import StorageError, UsageError
from blackbox.history import Exchange, Plan
from blackbox.secrets import Redactor, check_env_name

if TYPE_CHECKING:
    from blackbox.history import History
    from blackbox.server_info import ServerInfo
    from blackbox.verdict import Finding

__all__ = [
    "RunStore",
    "curl_command",
    "load_history",
    "load_preflight",
    "load_servers",
    "new_run_id",
    "write_traceback",
]


def new_run_id(seed: int) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime()) + f"-s{seed}"


class RunStore:
    def __init__(self, root: Path, run_id: str, redact: Redactor | None = None) -> None:
        self.path = root / run_id
        self.redact = redact or Redactor()
        self.recorded = 0  # exchanges written, for the message of a run that was stopped
        self.path.mkdir(parents=True, exist_ok=False)
        self._exchanges = self._guard("exchanges.jsonl", lambda: (self.path / "exchanges.jsonl").open("a"))

    def _guard(self, name: str, write: Any) -> Any:
        try:
            return write()
        except OSError as exc:
            raise StorageError(
                f"cannot write {self.path / name}: {exc.strerror or exc or type(exc).__name__}",
                hint="free disk space or fix the folder's permissions, then re-run",
            ) from exc

    def write_plans(self, plans: Sequence[Plan], yardstick: Sequence[Plan] = ()) -> None:
        """The multiturn probe's conversations as planned (`load_history` reads them back)."""
        self.write_json("plans.json", [p.__dict__ for p in plans])
        if yardstick:
            self.write_json("yardstick-plans.json", [p.__dict__ for p in yardstick])

    def write_json(self, name: str, data: Any) -> Path:
        text = self.redact(json.dumps(data, indent=2, sort_keys=True, default=str)) + "\n"
        target = self.path / name

        def write() -> Path:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(target.suffix + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)
            return target

        return self._guard(name, write)

    def write_text(self, name: str, text: str) -> Path:
        target = self.path / name

        def write() -> Path:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(self.redact(text), encoding="utf-8")
            return target

        return self._guard(name, write)

    def append_jsonl(self, name: str, record: Mapping[str, Any]) -> None:
        """One line per call, flushed, for logs kept while the run goes on (retries, scrapes)."""
        line = self.redact(json.dumps(dict(record), default=str)) + "\n"
        target = self.path / name

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("a", encoding="utf-8") as f:
                f.write(line)

        self._guard(name, write)

    def record(self, exchange: Exchange) -> None:
        """Append as soon as an exchange completes, so an interrupted run loses nothing already recorded."""
        line = self.redact(json.dumps(exchange.to_json(), default=str)) + "\n"

        def write() -> None:
            self._exchanges.write(line)
            self._exchanges.flush()
            self.recorded += 1

        self._guard("exchanges.jsonl", write)

    def write_replays(
        self,
        base_urls: Mapping[str, str],
        exchanges: Iterable[Exchange],
        api_key_env: str,
        key_file: str | None = None,
    ) -> list[Path]:
        written = []
        for e in exchanges:
            url = base_urls.get(e.arm)
            if url:
                script = "#!/bin/sh\n" + curl_command(url, e, api_key_env, key_file) + "\n"
                written.append(self.write_text(f"replay/{e.case_id}.sh", script))
        return written

    def copy_logs(self, log_dir: Path) -> None:
        if log_dir.is_dir():
            self._guard("servers", lambda: shutil.copytree(log_dir, self.path / "servers", dirs_exist_ok=True))

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a full disk fails the last flush too; the verdict says StorageError
            self._exchanges.close()


def curl_command(base_url: str, exchange: Exchange, api_key_env: str, key_file: str | None = None) -> str:
    """A ready-to-paste curl; the key is referenced as a shell variable (or read from its file when the run
    used --api-key-file), never written out. Every other word is shell-quoted."""
    check_env_name(api_key_env)  # the one unquoted word: `${NAME:-}` must stay a plain variable reference
    body = json.dumps(dict(exchange.request), separators=(",", ":"))
    if key_file:
        auth = f'"Authorization: Bearer $(cat {shlex.quote(key_file)})"'
    else:
        auth = f'"Authorization: Bearer ${{{api_key_env}:-}}"'
    parts = [
        "curl -sS",
        shlex.quote(f"{base_url.rstrip('/')}/v1/chat/completions"),
        "-H 'Content-Type: application/json'",
        "-H",
        shlex.quote(f"X-Blackbox-Case: {exchange.case_id}"),
        "-H",
        auth,
        "-d",
        shlex.quote(body),
    ]
    return " ".join(parts)


def load_servers(run_dir: Path) -> dict[str, ServerInfo] | None:
    """What each server said of itself (servers.json), or None for a run folder without it."""
    from blackbox.server_info import ServerInfo

    path = run_dir / "servers.json"
    if not path.exists():
        return None
    try:
        return {arm: ServerInfo.from_json(info) for arm, info in json.loads(path.read_text()).items()}
    except (ValueError, LookupError, TypeError, AttributeError) as exc:
        raise UsageError(
            f"{path} is malformed ({type(exc).__name__}: {str(exc)[:160]}); was the run cut short or the file edited?",
            hint="re-run the command in command.txt to get a complete run folder",
        ) from exc


def load_preflight(run_dir: Path) -> list[Finding]:
    """The role and comparability findings made before the workload, so a re-grade keeps them. A run folder from
    before they were stored has none, and says so as a failed gate rather than passing without them."""
    from blackbox.errors import NoEvidence
    from blackbox.verdict import Finding

    path = run_dir / "preflight.json"
    if not path.exists():
        return [Finding.from_error("preflight", NoEvidence(f"{path} is missing: the roles were never checked"))]
    try:
        return [Finding.from_json(f) for f in json.loads(path.read_text())]
    except (ValueError, LookupError, TypeError, AttributeError) as exc:
        raise UsageError(
            f"{path} is malformed ({type(exc).__name__}: {str(exc)[:160]}); was the run cut short or the file edited?",
            hint="re-run the command in command.txt to get a complete run folder",
        ) from exc


def load_history(run_dir: Path) -> tuple[dict[str, Any], History]:
    """Rebuild a run's config and History from its folder, so a run can be re-graded without the servers.
    A file that is cut short or malformed is a `UsageError` naming the file (and line), not a traceback."""
    reading = _Reading(run_dir)
    try:
        return _load_history(run_dir, reading)
    except (ValueError, LookupError, TypeError, AttributeError) as exc:
        raise UsageError(
            f"{reading.where()} is malformed ({type(exc).__name__}: {str(exc)[:160]}); was the run cut short "
            "or the file edited?",
            hint="re-run the command in command.txt to get a complete run folder",
        ) from exc


class _Reading:
    """Which file (and line) load_history is on, for the message when one is malformed."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.file = "config.json"
        self.line: int | None = None

    def json(self, name: str) -> Any:
        self.file, self.line = name, None
        return json.loads((self.run_dir / name).read_text())

    def where(self) -> str:
        return str(self.run_dir / self.file) + (f" line {self.line}" if self.line else "")


def _load_history(run_dir: Path, reading: _Reading) -> tuple[dict[str, Any], History]:
    from blackbox.client import parse_chat
    from blackbox.history import History, Plan, RaceRound
    from blackbox.metrics import MetricsDelta, MetricsSnapshot, from_compact, parse
    from blackbox.server_info import ServerInfo

    config = reading.json("config.json")
    geometry = reading.json("geometry.json")

    def plans(name: str) -> list[Plan]:
        return [
            Plan(**{**p, "turn1_messages": tuple(p["turn1_messages"]), "probe_messages": tuple(p["probe_messages"])})
            for p in (reading.json(name) if (run_dir / name).exists() else [])
        ]

    race = reading.json("race.json") if (run_dir / "race.json").exists() else {"rounds": [], "budget": None}
    exchanges = []
    reading.file = "exchanges.jsonl"
    for number, line in enumerate((run_dir / "exchanges.jsonl").read_text().splitlines(), 1):
        reading.line = number
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
                started_s=e.get("started_s"),  # absent in folders from before the report's timeline
                **parsed,
            )
        )

    def delta(before: Path, after: Path, during: Sequence[MetricsSnapshot] = ()) -> MetricsDelta | None:
        if not after.exists():
            return None
        reading.file, reading.line = str(before.relative_to(run_dir)), None
        return MetricsDelta(parse(before.read_text()), parse(after.read_text()), tuple(during))

    def scrapes(arm: str) -> list[MetricsSnapshot]:
        path = run_dir / "metrics" / f"{arm}-scrapes.jsonl"
        reading.file = str(path.relative_to(run_dir))
        out: list[MetricsSnapshot] = []
        for number, line in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
            reading.line = number
            record = json.loads(line)
            if "error" not in record:
                out.append(from_compact(record, out[-1] if out else None))
        return out

    deltas = {}
    for before in sorted((run_dir / "metrics").glob("*-before.prom")):
        arm = before.name.removesuffix("-before.prom")
        if (d := delta(before, before.with_name(f"{arm}-after.prom"), scrapes(arm))) is not None:
            deltas[arm] = d
    window = run_dir / "metrics" / "race-window"
    race_window = delta(window / "before.prom", window / "after.prom")
    rounds = tuple(RaceRound(**r) for r in race["rounds"])
    servers = run_dir / "servers.json"
    info = json.loads(servers.read_text()).get("treatment") if servers.exists() else None
    extras = {path.stem: reading.json(f"probes/{path.name}") for path in sorted((run_dir / "probes").glob("*.json"))}
    history = History(
        geometry["block_size"],
        tuple(plans("plans.json")),
        tuple(exchanges),
        deltas,
        rounds,
        race.get("budget"),
        race_window,
        ServerInfo.from_json(info) if info else None,
        tuple(plans("yardstick-plans.json")),
        extras,
    )
    return config, history


def write_traceback(folder: Path, text: str, redact: Redactor, name: str = "traceback.txt") -> Path | None:
    """Keep an internal error's traceback in the run folder, off the terminal; None if it cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / name
        target.write_text(redact(text), encoding="utf-8")
    except OSError:
        return None
    return target
