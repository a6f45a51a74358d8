"""What runs beside the conversations: the heartbeat and the periodic scrapes."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from blackbox.errors import EndpointError
from blackbox.watch import Heartbeat, Watch


class Flaky:
    arm = "treatment"

    def __init__(self) -> None:
        self.calls = 0

    async def metrics(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise EndpointError("gone for a moment")
        if self.calls == 2:
            raise RuntimeError("a bug in a parser")


async def test_scrapes_go_on_after_a_failure_and_record_an_unexpected_one() -> None:
    records: list[tuple[str, Mapping[str, Any]]] = []
    watch = Watch(scrape_s=0.01, on_scrape=lambda arm, r: records.append((arm, r)))
    flaky = Flaky()
    async with watch.running([flaky]):
        while flaky.calls < 4:
            await asyncio.sleep(0.01)
    assert [r["error"] for _, r in records] == ["RuntimeError: a bug in a parser"]


async def test_one_heartbeat_line_for_the_oldest_request_in_flight() -> None:
    lines: list[str] = []
    beat = Heartbeat(0.05, lines.append)
    with beat.waiting("treatment (http://t:1)", "GET /health", 30), beat.waiting("control (http://c:1)", "GET /x", 30):
        assert beat.beat() is None  # not waited long enough yet
        await asyncio.sleep(0.06)
        line = beat.beat()
    assert line is not None
    assert line.startswith("blackbox: still waiting on treatment (http://t:1) for GET /health: ")
    assert line.endswith("s so far (timeout 30 s); 1 more request in flight")
    assert beat.beat() is None  # nothing in flight
