"""The same faults on the real CPU pair: a proxy in front of each real vLLM server injects them.

Small on purpose (the session's treatment and control, two short conversations per case): the fake pair covers the
faults at breadth (tests/test_reliability.py); these prove the paths hold against real vLLM traffic, real
/metrics pages and real timing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_server import Kill, Proxy, Reply, Slow
from test_reliability import CANARY, assert_consistent, run_cli

from servers.launch import Fleet

pytestmark = pytest.mark.engine

SMALL = ("--conversations", "2", "--prompt-blocks", "2", "--answer-blocks", "1", "--scrape-interval", "0.5")
COUNTER = re.compile(r"^(vllm:\S+_total(?:\{[^}]*\})?) (\S+)$", re.MULTILINE)


@pytest.fixture(autouse=True)
def canary_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLACKBOX_API_KEY", CANARY)


@pytest.fixture
def proxied(cpu_fleet: Fleet) -> Iterator[Callable[..., tuple[str, str]]]:
    """Proxies in front of the session's pair: the faults live in the proxies, so the real servers stay as they were."""
    started: list[Proxy] = []

    def start(**treatment: Any) -> tuple[str, str]:
        t = Proxy(upstream=cpu_fleet.urls["treatment"], echo_headers=True, **treatment).start()
        c = Proxy(upstream=cpu_fleet.urls["control"], echo_headers=True).start()
        started.extend([t, c])
        return t.url, c.url

    yield start
    for p in started:
        p.stop()


def chat_fault(action: Callable[[int], Any]) -> Callable[[str, int, dict[str, str]], Any]:
    return lambda path, n, headers: action(n) if path == "/v1/chat/completions" else None


SERVER = r"treatment at http://127\.0\.0\.1:\d+"


def test_real_server_killed_mid_run(
    proxied: Callable[..., tuple[str, str]], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    t, c = proxied(fault=chat_fault(lambda n: Kill() if n >= 3 else None))
    outcome = run_cli(capfd, tmp_path, "--treatment", t, "--control", c, *SMALL)
    assert_consistent(outcome, "EndpointError", 4, SERVER + r": GET /metrics failed: ConnectError")


def test_real_server_slower_than_the_request_timeout(
    proxied: Callable[..., tuple[str, str]], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    t, c = proxied(fault=chat_fault(lambda n: Slow(8) if n >= 2 else None))
    outcome = run_cli(capfd, tmp_path, "--treatment", t, "--control", c, *SMALL, "--request-timeout", "4")
    assert_consistent(outcome, "EndpointError", 4, SERVER + r" did not answer POST /v1/chat/completions within 4 s")


def test_real_server_restart_seen_at_one_mid_run_scrape(
    proxied: Callable[..., tuple[str, str]], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """One scrape shows every vLLM counter at zero, as a restarted server would; the settled counters at the
    end are back above the start, so only the scrapes taken during the run can tell."""
    state = {"chats": 0, "dipped": False}

    def fault(path: str, n: int, headers: dict[str, str]) -> None:
        if path == "/v1/chat/completions":
            state["chats"] = n

    def rewrite(n: int, text: str) -> str:
        if state["dipped"] or int(state["chats"]) < 2:
            return text
        state["dipped"] = True
        return COUNTER.sub(lambda m: f"{m.group(1)} 0.0", text)

    t, c = proxied(fault=fault, rewrite_metrics=rewrite)
    outcome = run_cli(capfd, tmp_path, "--treatment", t, "--control", c, *SMALL)
    assert state["dipped"]
    assert_consistent(outcome, "CounterReset", 2, r"treatment: counter vllm:\S+ went backwards")


def test_real_pair_error_body_echoing_the_key_is_redacted(
    proxied: Callable[..., tuple[str, str]], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    t, c = proxied(fault=chat_fault(lambda n: Reply(500) if n == 2 else None))
    outcome = run_cli(capfd, tmp_path, "--treatment", t, "--control", c, *SMALL)
    assert_consistent(outcome, "EndpointError", 4, r"1 of \d+ requests failed .*HTTP 500: .*\[REDACTED\]")
