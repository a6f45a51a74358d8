"""report.html in a real browser: headless Chromium (Debian's `chromium`), driven over the DevTools protocol.

For a PASS, a FAIL and an UNKNOWN run folder (tests/run_folders.py) `blackbox report` writes the pages, with a
canary API key in the environment; Chromium opens each from disk, and the page must show verdict.json's verdict,
load every figure, log no console error (a blocked fetch under the page's no-network policy is one), and
hold the canary nowhere. A screenshot of each is kept beside the run folder. A missing Chromium fails the test.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import run_folders
from websockets.sync.client import ClientConnection, connect

from blackbox.cli import main

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
)
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


def chromium_binary() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("no chromium on PATH: install Debian's package (`apt-get install -y chromium`; .ci/run does)")
    return found


@dataclass
class Page:
    """One tab, attached in flat mode: commands carry its session id, events for it are collected."""

    ws: ClientConnection
    session: str
    ids: Iterator[int]
    events: list[dict[str, Any]] = field(default_factory=list)

    def send(self, method: str, timeout_s: float = 60.0, **params: Any) -> dict[str, Any]:
        number = next(self.ids)
        self.ws.send(json.dumps({"id": number, "method": method, "params": params, "sessionId": self.session}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == number:
                assert "error" not in message, (method, message["error"])
                return dict(message.get("result") or {})
            self.events.append(message)

    def wait_for(self, method: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == method for e in self.events):
            self.events.append(json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic()))))

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def errors(self) -> list[str]:
        out = []
        for e in self.events:
            method, params = e.get("method"), e.get("params") or {}
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                out.append(str(params.get("exceptionDetails")))
            elif method == "Log.entryAdded" and (params.get("entry") or {}).get("level") == "error":
                out.append(str(params["entry"].get("text")))
        return out


class Browser:
    def __init__(self, profile: Path) -> None:
        self.proc = subprocess.Popen(
            [chromium_binary(), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(connect(self._devtools_url(), max_size=64 * 2**20, open_timeout=30))
        self.ids = itertools.count(1)

    def _devtools_url(self) -> str:
        assert self.proc.stderr is not None
        seen = []
        for line in self.proc.stderr:  # Chromium names its DevTools socket on stderr once it is up
            seen.append(line)
            if m := _LISTENING.search(line):
                return m.group(1)
        raise AssertionError("chromium exited before its DevTools socket was up:\n" + "".join(seen[-20:]))

    def _browser_call(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self.ids)
        self.ws.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == number:
                assert "error" not in message, (method, message["error"])
                return dict(message.get("result") or {})

    def open(self, path: Path) -> Page:
        target = self._browser_call("Target.createTarget", url="about:blank")["targetId"]
        session = self._browser_call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        page = Page(self.ws, session, self.ids)
        for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
            page.send(domain)
        page.send("Page.navigate", url=path.resolve().as_uri())
        page.wait_for("Page.loadEventFired")
        return page

    def close(self) -> None:
        with contextlib.suppress(Exception):  # it may be gone already; the process is reaped below either way
            self._browser_call("Browser.close")
        self._stack.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    folders = run_folders.three(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BLACKBOX_API_KEY", run_folders.CANARY)  # the run's key is in the environment of the report
        assert main(["report", *map(str, folders.values()), "--out", str(root / "runs.html")]) == 0
    return folders


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


@pytest.mark.parametrize("status", ["PASS", "FAIL", "UNKNOWN"])
def test_the_report_shows_the_stored_verdict_with_every_figure_and_no_secret(
    status: str, reports: dict[str, Path], browser: Browser
) -> None:
    run_dir = reports[status]
    stored = run_folders.stored_verdict(run_dir)
    assert stored["status"] == status  # the folder is the kind this case is about
    page = browser.open(run_dir / "report.html")
    shown = page.evaluate(
        "({verdict: document.getElementById('verdict').textContent,"
        " cls: (document.getElementById('error-class') || {}).textContent || null,"
        " exit: document.getElementById('exit-code').textContent,"
        " reason: document.getElementById('reason').textContent,"
        " html: document.documentElement.outerHTML})"
    )
    assert (shown["verdict"], shown["cls"], shown["exit"]) == (
        stored["status"],
        stored["error_class"],
        str(stored["exit_code"]),
    )
    assert shown["reason"] == stored["reason"]
    images = page.evaluate(
        "Promise.all([...document.images].map(i => i.decode().then(() => [i.alt, i.naturalWidth], () => [i.alt, 0])))"
    )
    # The figures a folder with a reference, a drafter and timed requests has data for: none may be left out.
    assert {alt for alt, _ in images} == {
        "decode-region deviations",
        "prefill-region deviations",
        "where turn-2 hits resumed",
        "drafter acceptance",
        "request timeline",
    }
    assert all(width > 0 for _, width in images), images
    assert page.errors() == []
    shot = base64.b64decode(page.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
    assert shot.startswith(b"\x89PNG") and len(shot) > 20_000
    (run_dir.parent / f"{status}.png").write_bytes(shot)
    for text in (shown["html"], (run_dir / "report.html").read_text(encoding="utf-8")):
        for piece in (run_folders.CANARY, run_folders.CANARY[-12:], run_folders.CANARY[:14]):
            assert piece not in text


def test_the_comparison_page_links_each_run_with_its_verdict(reports: dict[str, Path], browser: Browser) -> None:
    page = browser.open(next(iter(reports.values())).parent / "runs.html")
    rows = page.evaluate(
        "[...document.querySelectorAll('table.compare tr')].slice(1).map(r =>"
        " [r.querySelector('a').getAttribute('href'), r.querySelector('.st').textContent])"
    )
    assert rows == [[f"{d.name}/report.html", status] for status, d in reports.items()]
    assert page.errors() == []
