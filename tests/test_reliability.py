"""Faults a tester must survive without a verdict it did not earn: no crash or hang reads as PASS or FAIL.

Every case runs `blackbox run` against a fault-injecting fake pair (tests/fake_server.py) with a canary API key,
and asserts the class, the exit code, the message, a consistent verdict.json, and that the canary appears in no
file of the run folder and nowhere on the console. The unfaulted fake pair is PASS (first test), so each
non-PASS below is the fault's doing. Usage errors are checked before any folder is made.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fake_server import Close, Counters, CutBody, FakeVLLM, Hang, Kill, Reply, Slow, free_port, render_metrics, wait_for

from blackbox import errors, gates
from blackbox.cli import main
from blackbox.store import RunStore, load_history

CANARY = "sk-canary-7f3a9c2e5b1d4f60a8e2"
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str
    out_dir: Path

    @property
    def console(self) -> str:
        return self.out + self.err

    @property
    def run_dir(self) -> Path:
        runs = [p for p in self.out_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
        assert len(runs) == 1, (runs, self.console)
        return runs[0]

    @property
    def verdict(self) -> dict[str, Any]:
        path = self.run_dir / "verdict.json"
        assert path.is_file(), f"no verdict.json in {self.run_dir}:\n{self.console}"
        return dict(json.loads(path.read_text()))


def assert_no_canary(outcome: Outcome) -> None:
    """The key, whole or cut, in no artifact and not on the console."""
    pieces = (CANARY, CANARY[-12:], CANARY[:14])
    for piece in pieces:
        assert piece not in outcome.console, f"{piece!r} on the console"
    for path in outcome.out_dir.rglob("*"):
        if path.is_file():
            text = path.read_bytes().decode("utf-8", "replace")
            for piece in pieces:
                assert piece not in text, f"{piece!r} in {path}"


def run_cli(capfd: pytest.CaptureFixture[str], out: Path, *args: str) -> Outcome:
    code = main(["run", *args, "--out", str(out)])
    captured = capfd.readouterr()
    return Outcome(code, captured.out, captured.err, out)


def chat_fault(action: Callable[[int], Any]) -> Callable[[str, int, dict[str, str]], Any]:
    return lambda path, n, headers: action(n) if path == "/v1/chat/completions" else None


def path_fault(target: str, action: Any, after: int = 0) -> Callable[[str, int, dict[str, str]], Any]:
    return lambda path, n, headers: action if path == target and n > after else None


def chats(server: FakeVLLM) -> int:
    return server.calls.get("/v1/chat/completions", 0)


def dip_once(after_chats: int, server: list[FakeVLLM]) -> Callable[[int, Counters], str | None]:
    """One scrape that reads like a freshly restarted server (counters near zero); every later one is normal,
    i.e. above the first: caught only by a scrape taken during the run."""
    state = {"done": False}

    def override(n: int, c: Counters) -> str | None:
        if state["done"] or chats(server[0]) < after_chats:
            return None
        state["done"] = True
        zero = Counters(0.0, 0.0, 0.0, 0.0, 0.0, created=c.created, start_time=c.start_time)
        return render_metrics(zero, typed=server[0].typed)

    return override


def shift(after_chats: int, server: list[FakeVLLM], **changes: float) -> Callable[[int, Counters], str | None]:
    """From `after_chats` on, fields of the counters change (e.g. `_created`) while every counter keeps growing."""

    def override(n: int, c: Counters) -> str | None:
        if chats(server[0]) >= after_chats:
            for k, v in changes.items():
                setattr(c, k, v)
        return None

    return override


@dataclass(frozen=True)
class Case:
    name: str
    error_class: str
    exit_code: int
    message: str  # a regex the verdict's reason and the console must both match
    treatment: Callable[[list[FakeVLLM]], dict[str, Any]] = lambda me: {}
    control: Callable[[list[FakeVLLM]], dict[str, Any]] = lambda me: {}
    args: tuple[str, ...] = ()
    console: str = ""  # a further regex the console must match (a heartbeat, a warning)
    retries: Callable[[list[dict[str, Any]]], bool] | None = None  # a check of retries.jsonl
    env: dict[str, str] = field(default_factory=dict)


SERVER = r"treatment at http://127\.0\.0\.1:\d+"
CASES = [
    Case(
        "health-never-answers",
        "EndpointError",
        4,
        SERVER + r" did not answer GET /health within 1 s",
        treatment=lambda me: {"fault": path_fault("/health", Hang())},
        args=("--request-timeout", "1", "--heartbeat", "0.3"),
        console=r"still waiting on treatment \(http://127\.0\.0\.1:\d+\) for GET /health: \d+ s so far",
    ),
    Case(
        "chat-slower-than-request-timeout",
        "EndpointError",
        4,
        SERVER + r" did not answer POST /v1/chat/completions within 0\.5 s",
        treatment=lambda me: {"fault": chat_fault(lambda n: Slow(3))},
        args=("--request-timeout", "0.5", "--heartbeat", "0.2"),
        # The first chat is the comparability check's short greedy request, before any conversation.
        console=r"still waiting on treatment .* for POST /v1/chat/completions \[c-01-treatment-comparability\]",
    ),
    Case(
        "whole-run-deadline",
        "DeadlineExceeded",
        4,
        r"the run did not finish within --deadline 1 s \(while .*\d+ requests recorded",
        treatment=lambda me: {"fault": chat_fault(lambda n: Slow(0.4))},
        args=("--deadline", "1"),
    ),
    Case(
        "unauthorized-401",
        "ConfigMismatch",
        3,
        SERVER
        + r" answered GET /v1/models with HTTP 401: is the API key right\? \(the key comes from \$BLACKBOX_API_KEY",
        treatment=lambda me: {"fault": path_fault("/v1/models", Reply(401))},
    ),
    Case(
        "unset-key-variable-then-401",
        "ConfigMismatch",
        3,
        r"HTTP 401: is the API key right\? \(no key sent: \$MY_UNSET_KEY is not set\)",
        treatment=lambda me: {"fault": path_fault("/v1/models", Reply(401))},
        args=("--api-key-env", "MY_UNSET_KEY"),
        console=r"warning: \$MY_UNSET_KEY \(named by --api-key-env\) is not set",
    ),
    Case(
        "not-found-404-v1-suffix",
        "ConfigMismatch",
        3,
        SERVER + r" answered GET /v1/models with HTTP 404: pass the server root as the URL \(no /v1 suffix\)",
        treatment=lambda me: {"fault": path_fault("/v1/models", Reply(404))},
    ),
    Case(
        "wrong-model",
        "ConfigMismatch",
        3,
        SERVER + r" does not serve model 'qwen-huge' \(it serves 'fake-model'\)",
        args=("--model", "qwen-huge"),
    ),
    Case(
        "not-vllm",
        "ConfigMismatch",
        3,
        SERVER + r": /metrics has no vllm:\* series; is this a vLLM server\?",
        treatment=lambda me: {"metrics_override": lambda n, c: "http_requests_total 3\nprocess_start_time_seconds 1\n"},
    ),
    Case(
        "metrics-not-prometheus",
        "EndpointError",
        4,
        SERVER + r"/metrics is not Prometheus text",
        treatment=lambda me: {"metrics_override": lambda n, c: "<html><body>502 Bad Gateway</body></html>\n"},
    ),
    Case(
        "metrics-vanish-mid-run",
        "EndpointError",
        4,
        SERVER + r" answered GET /metrics with HTTP 404",
        treatment=lambda me: {"fault": path_fault("/metrics", Reply(404), after=3)},
        console=r"/metrics answered earlier in this run",
    ),
    Case(
        "server-killed-mid-run",
        "EndpointError",
        4,
        # The settled scrape, the requests' own failures or a later prompt's sizing (run beside the conversations)
        # may be the first to tell: each names the server.
        SERVER + r": (GET /metrics|POST /v1/chat/completions|POST /tokenize) failed: ConnectError",
        treatment=lambda me: {"fault": chat_fault(lambda n: Kill() if n >= 3 else None)},
        retries=lambda rs: any("ConnectError" in r["reason"] for r in rs),
    ),
    Case(
        "truncated-json",
        "EndpointError",
        4,
        SERVER + r" answered POST /v1/chat/completions with a body that is not JSON, maybe truncated",
        treatment=lambda me: {"fault": chat_fault(lambda n: Reply(200, b'{"id": "chatcmpl-1", "choices": [{"ind'))},
    ),
    Case(
        "connection-dropped-mid-body",
        "EndpointError",
        4,
        SERVER + r": POST /v1/chat/completions failed: RemoteProtocolError",
        treatment=lambda me: {"fault": chat_fault(lambda n: CutBody())},
        retries=lambda rs: any(r.get("gave_up") for r in rs) and any(r["attempt"] == 3 for r in rs),
    ),
    Case(
        "connection-closed-without-response",
        "EndpointError",
        4,
        SERVER + r": POST /v1/chat/completions failed: RemoteProtocolError",
        treatment=lambda me: {"fault": chat_fault(lambda n: Close())},
        retries=lambda rs: all("RemoteProtocolError" in r["reason"] for r in rs) and len(rs) >= 4,
    ),
    Case(
        "rate-limited-429-honours-retry-after",
        "EndpointError",
        4,
        SERVER + r" answered GET /health with HTTP 429 after 4 attempts",
        treatment=lambda me: {"fault": path_fault("/health", Reply(429, b"slow down", (("Retry-After", "1"),)))},
        retries=lambda rs: (
            [r.get("wait_s") for r in rs if not r.get("gave_up")] == [1.0, 1.0, 1.0] and rs[-1]["gave_up"]
        ),
    ),
    Case(
        "retry-after-beyond-the-budget-gives-up-at-once",
        "EndpointError",
        4,
        SERVER + r" answered GET /health with HTTP 429",
        treatment=lambda me: {"fault": path_fault("/health", Reply(429, b"", (("Retry-After", "3600"),)))},
        retries=lambda rs: len(rs) == 1 and rs[0]["gave_up"] and rs[0]["attempt"] == 1,
    ),
    Case(
        "unavailable-503-retried-then-given-up",
        "EndpointError",
        4,
        SERVER + r" answered GET /v1/models with HTTP 503 after 4 attempts",
        treatment=lambda me: {"fault": path_fault("/v1/models", Reply(503))},
        retries=lambda rs: len([r for r in rs if not r.get("gave_up")]) == 3 and "HTTP 503" in rs[0]["reason"],
    ),
    Case(
        "bad-request-400-not-retried",
        "EndpointError",
        4,
        SERVER + r" answered POST /v1/chat/completions with HTTP 400",
        treatment=lambda me: {"fault": chat_fault(lambda n: Reply(400))},
        retries=lambda rs: rs == [],
    ),
    Case(
        "restart-counters-dip-at-one-scrape",
        "CounterReset",
        2,
        r"treatment: counter vllm:\S+ went backwards .*: the server restarted mid-run",
        treatment=lambda me: {"metrics_override": dip_once(3, me)},
    ),
    Case(
        "restart-created-changed",
        "CounterReset",
        2,
        r"treatment: vllm:\S+_created changed \(1750000000 -> 1760000000\)",
        treatment=lambda me: {"metrics_override": shift(3, me, created=1.76e9)},
    ),
    Case(
        "restart-process-start-time-changed",
        "CounterReset",
        2,
        r"control: process_start_time_seconds changed \(1750000000 -> 1750000999\)",
        control=lambda me: {"metrics_override": shift(1, me, start_time=1750000999.0)},  # 1 chat per conversation
    ),
    Case(
        "restart-untyped-counters",
        "CounterReset",
        2,
        r"treatment: counter vllm:\S+ went backwards",
        treatment=lambda me: {"typed": False, "metrics_override": dip_once(3, me)},
        args=("--block-size", "16"),
    ),
]


@pytest.fixture
def pair() -> Iterator[Callable[[Case], tuple[FakeVLLM, FakeVLLM]]]:
    started: list[FakeVLLM] = []

    def start(case: Case) -> tuple[FakeVLLM, FakeVLLM]:
        me_t: list[FakeVLLM] = []
        me_c: list[FakeVLLM] = []
        t = FakeVLLM(**case.treatment(me_t))
        c = FakeVLLM(caching=False, **case.control(me_c))
        me_t.append(t)
        me_c.append(c)
        started.extend([t.start(), c.start()])
        return t, c

    yield start
    for s in started:
        s.stop()


@pytest.fixture(autouse=True)
def canary_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLACKBOX_API_KEY", CANARY)
    monkeypatch.delenv("MY_UNSET_KEY", raising=False)


def assert_consistent(outcome: Outcome, error_class: str, exit_code: int, message: str) -> dict[str, Any]:
    verdict = outcome.verdict
    assert outcome.code == exit_code, outcome.console
    assert verdict["exit_code"] == exit_code and verdict["error_class"] == error_class, verdict
    assert verdict["status"] not in ("PASS", "FAIL") and error_class != "CorruptionDetected"
    expected = getattr(errors, error_class)
    assert expected.exit_code == exit_code
    assert verdict["status"] == ("UNKNOWN" if issubclass(expected, errors.Inconclusive) else "ERROR")
    assert re.search(message, verdict["reason"]), verdict["reason"]
    assert re.search(message, outcome.out), outcome.out  # the summary printed says the same
    assert "Traceback" not in outcome.console
    assert_no_canary(outcome)
    return verdict


def test_the_unfaulted_fake_pair_passes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], pair: Callable[[Case], tuple[FakeVLLM, FakeVLLM]]
) -> None:
    """The baseline: without a fault the fake pair is PASS, so each fault case's non-PASS is the fault's."""
    t, c = pair(Case("clean", "", 0, ""))
    # 8 conversations: the fewest whose recall sign test can reach p < 0.01 (2^-8), so a PASS is possible at all.
    outcome = run_cli(capfd, tmp_path, "--treatment", t.url, "--control", c.url, "--conversations", "8")
    assert outcome.code == 0, outcome.console
    assert outcome.verdict["status"] == "PASS"
    assert t.calls.get("/metrics", 0) >= 4  # ready, before, settle... and the periodic scrapes
    scrapes = (outcome.run_dir / "metrics" / "treatment-scrapes.jsonl").read_text().splitlines()
    # Every scrape is stored; one periodic scrape may have been cut off in flight when the run ended.
    assert t.calls["/metrics"] - 1 <= len(scrapes) <= t.calls["/metrics"]
    assert_no_canary(outcome)  # the fake echoes the Authorization header into every answer


def test_the_reference_runs_the_yardstick_conversations_alone(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], pair: Callable[[Case], tuple[FakeVLLM, FakeVLLM]]
) -> None:
    t, c = pair(Case("clean", "", 0, ""))
    r = FakeVLLM(speculative=False).start()
    try:
        outcome = run_cli(
            capfd, tmp_path, "--treatment", t.url, "--control", c.url, "--reference", r.url,
            "--conversations", "4", "--reference-ratio", "3",
        )  # fmt: skip
    finally:
        r.stop()
    assert outcome.verdict["error_class"] not in ("EndpointError", "UsageError", "InternalError"), outcome.console
    rows = [json.loads(line) for line in (outcome.run_dir / "exchanges.jsonl").read_text().splitlines()]
    turn2 = {arm: sorted(e["conversation"] for e in rows if e["arm"] == arm and e["kind"] == "turn2") for arm in
             ("treatment", "control", "reference")}  # fmt: skip
    assert turn2 == {"treatment": [0, 1, 2, 3], "control": [0, 1, 2, 3], "reference": list(range(12))}
    # The progress line counts every conversation the run drives, the reference's extras too, from its first line.
    denominators = re.findall(r"\] \d+/(\d+) conversations", outcome.err)
    assert denominators and set(denominators) == {"12"}, outcome.err
    stored = json.loads((outcome.run_dir / "config.json").read_text())
    assert stored["reference_ratio"] == 3
    plans = json.loads((outcome.run_dir / "plans.json").read_text())
    extra = json.loads((outcome.run_dir / "yardstick-plans.json").read_text())
    assert [p["index"] for p in plans] == [0, 1, 2, 3] and [p["index"] for p in extra] == list(range(4, 12))
    _, history = load_history(outcome.run_dir)
    assert len(history.plans) == 4 and len(history.plans_of("reference")) == 12


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault(
    case: Case,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    pair: Callable[[Case], tuple[FakeVLLM, FakeVLLM]],
) -> None:
    t, c = pair(case)
    args = ("--treatment", t.url, "--control", c.url, "--conversations", "2", "--scrape-interval", "0.2")
    outcome = run_cli(capfd, tmp_path, *args, *case.args)
    assert_consistent(outcome, case.error_class, case.exit_code, case.message)
    if case.console:
        assert re.search(case.console, outcome.console), outcome.console
    if case.error_class == "CounterReset":  # the scrapes are stored: the folder alone re-judges the same
        assert main(["grade", str(outcome.run_dir)]) == 2
        regraded = capfd.readouterr()
        assert re.search(case.message, regraded.out), regraded.out + regraded.err
    retries_file = outcome.run_dir / "retries.jsonl"
    if case.retries is not None:
        records = [json.loads(line) for line in retries_file.read_text().splitlines()] if retries_file.exists() else []
        assert case.retries(records), records


# --- faults of blackbox itself --------------------------------------------------------------------------------


def test_an_unexpected_exception_is_internal_error_with_the_traceback_in_the_run_folder(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    pair: Callable[[Case], tuple[FakeVLLM, FakeVLLM]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError(f"a bug that mentions the key {CANARY}")

    monkeypatch.setattr(gates, "all_gates", broken)
    t, c = pair(Case("internal", "", 0, ""))
    outcome = run_cli(capfd, tmp_path, "--treatment", t.url, "--control", c.url, "--conversations", "2")
    verdict = assert_consistent(
        outcome, "InternalError", 5, r"blackbox itself failed: RuntimeError at test_reliability\.py:\d+"
    )
    assert "traceback.txt" in verdict["hint"]
    trace = (outcome.run_dir / "traceback.txt").read_text()
    assert (
        "Traceback (most recent call last)" in trace and "RuntimeError: a bug that mentions the key [REDACTED]" in trace
    )


def test_a_full_disk_is_storage_error(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    pair: Callable[[Case], tuple[FakeVLLM, FakeVLLM]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full(self: RunStore, exchange: Any) -> None:
        self._guard("exchanges.jsonl", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))

    monkeypatch.setattr(RunStore, "record", full)
    t, c = pair(Case("disk", "", 0, ""))
    outcome = run_cli(capfd, tmp_path, "--treatment", t.url, "--control", c.url, "--conversations", "2")
    assert_consistent(outcome, "StorageError", 6, r"cannot write \S+exchanges\.jsonl: No space left on device")


# --- signals, and `blackbox grade` on what they leave -----------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_run_writes_an_interrupted_verdict_and_grade_says_so(
    signum: signal.Signals, tmp_path: Path, pair: Callable[[Case], tuple[FakeVLLM, FakeVLLM]]
) -> None:
    t, c = pair(Case("signal", "", 0, "", treatment=lambda me: {"fault": chat_fault(lambda n: Hang())}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BLACKBOX_API_KEY": CANARY}
    cmd = [sys.executable, "-m", "blackbox.cli", "run", "--treatment", t.url, "--control", c.url]
    proc = subprocess.Popen(
        [*cmd, "--conversations", "2", "--out", str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: chats(t) >= 1)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    outcome = Outcome(proc.returncode, out, err, tmp_path)
    assert_consistent(outcome, "Interrupted", 130, rf"interrupted by {signum.name} \(while .*\)")
    graded = subprocess.run(
        [sys.executable, "-m", "blackbox.cli", "grade", str(outcome.run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert graded.returncode == 130, graded.stderr
    assert re.search(r"Interrupted: \S+: the run was interrupted: run: interrupted by SIG", graded.stderr), (
        graded.stderr
    )
    assert "CacheNotLive" not in graded.stdout + graded.stderr and "[ok" not in graded.stdout


def test_grade_on_a_run_folder_without_verdict_says_it_was_killed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "exchanges.jsonl").write_text("")
    assert main(["grade", str(run)]) == 130
    assert "has no verdict.json: the run was killed before it finished" in capfd.readouterr().err


def test_grade_on_a_truncated_exchanges_file_names_the_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], pair: Callable[[Case], tuple[FakeVLLM, FakeVLLM]]
) -> None:
    t, c = pair(Case("clean", "", 0, ""))
    # 8 conversations: the fewest whose recall sign test can reach p < 0.01 (2^-8), so a PASS is possible at all.
    outcome = run_cli(capfd, tmp_path, "--treatment", t.url, "--control", c.url, "--conversations", "8")
    assert outcome.code == 0, outcome.console
    exchanges = outcome.run_dir / "exchanges.jsonl"
    lines = exchanges.read_text().splitlines()
    exchanges.write_text("\n".join(lines[:5]) + "\n" + lines[5][: len(lines[5]) // 2])
    assert main(["grade", str(outcome.run_dir)]) == 3
    err = capfd.readouterr().err
    assert re.search(r"UsageError: \S+exchanges\.jsonl line 6 is malformed \(JSONDecodeError", err), err
    assert "Traceback" not in err
    (outcome.run_dir / "exchanges.jsonl").write_text("\n".join(lines) + "\n")
    (outcome.run_dir / "preflight.json").write_text('[{"check": "roles", "sta')
    assert main(["grade", str(outcome.run_dir)]) == 3
    err = capfd.readouterr().err
    assert re.search(r"UsageError: \S+preflight\.json is malformed \(JSONDecodeError", err), err


# --- input checked before anything runs -------------------------------------------------------------------------


USAGE = [
    (
        ["--treatment", "http://127.0.0.1:99999"],
        r"--treatment 'http://127\.0\.0\.1:99999' is not a valid URL: Port out of range",
    ),
    (["--treatment", "http://[::1"], r"--treatment 'http://\[::1' is not a valid URL: Invalid IPv6 URL"),
    (["--treatment", "http://127.0.0.1:8000/v1"], r"ends in /v1, but blackbox adds /v1/chat/completions itself"),
    (["--treatment", "http://user:pw@127.0.0.1:8000"], r"must not carry credentials in the URL"),
    (["--treatment", "ftp://127.0.0.1:8000"], r"--treatment must be an http\(s\) URL"),
    (["--treatment-metrics", "http://127.0.0.1:70000/metrics"], r"--treatment-metrics .* Port out of range"),
    (["--alpha", "1.5"], r"--alpha must be between 0 and 1"),
    (["--alpha", "nan"], r"--alpha must be between 0 and 1"),
    (["--conversations", "0"], r"--conversations must be at least 1"),
    (["--compare-tokens", "0"], r"--compare-tokens must be at least 1"),
    (["--racers", "-3"], r"--racers must be at least 2"),
    (["--request-timeout", "0"], r"--request-timeout must be at least 0\.1, got 0"),
    (["--deadline", "-1"], r"--deadline must be at least 1, got -1"),
    (["--api-key-env", "X:-$(touch pwned)}"], r"--api-key-env must name an environment variable"),
    (["--api-key-file", "/nonexistent/key"], r"cannot read --api-key-file /nonexistent/key: FileNotFoundError"),
]


@pytest.mark.parametrize(("args", "message"), USAGE, ids=[" ".join(a) for a, _ in USAGE])
def test_bad_input_is_a_usage_error_before_any_run_folder(
    args: list[str], message: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    base = {"--treatment": url, "--control": url}
    flags = dict(zip(args[::2], args[1::2], strict=True))
    argv = [x for k, v in {**base, **flags}.items() for x in (k, v)]
    out = tmp_path / "runs"
    code = main(["run", *argv, "--out", str(out)])
    err = capfd.readouterr().err
    assert code == 3, err
    assert re.search(rf"blackbox: UsageError: .*{message}", err), err
    assert "Traceback" not in err and "$(touch" not in err  # the value is never echoed: it may be a key
    assert not [p for p in out.iterdir() if not p.name.startswith(".")] if out.exists() else True
    assert not (Path.cwd() / "pwned").exists()


def test_out_that_is_a_file_or_unwritable_is_a_usage_error(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main(["run", "--treatment", url, "--control", url, "--out", str(a_file)]) == 3
    assert "is a file, not a folder" in capfd.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code = main(["run", "--treatment", url, "--control", url, "--out", str(locked / "runs")])
    err = capfd.readouterr().err
    if os.geteuid() == 0:  # root writes anywhere: the folder is made, the run goes on to its endpoint error
        assert code == 4, err
    else:
        assert code == 3 and "is not writable" in err, err


def test_replay_scripts_quote_everything_and_read_the_key_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], pair: Callable[[Case], tuple[FakeVLLM, FakeVLLM]]
) -> None:
    key_file = tmp_path / "it's a key"
    key_file.write_text(CANARY + "\n")
    t, c = pair(Case("clean", "", 0, ""))
    out = tmp_path / "runs"
    outcome = run_cli(
        capfd, out, "--treatment", t.url, "--control", c.url, "--conversations", "8", "--api-key-file", str(key_file)
    )
    assert outcome.code == 0, outcome.console
    assert_no_canary(outcome)
    scripts = sorted((outcome.run_dir / "replay").glob("*.sh"))
    assert scripts
    fake = tmp_path / "bin" / "curl"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:{os.environ['PATH']}"}
    argv = subprocess.run(["sh", str(scripts[0])], env=env, capture_output=True, text=True, check=True).stdout
    assert f"Authorization: Bearer {CANARY}" in argv.splitlines()
