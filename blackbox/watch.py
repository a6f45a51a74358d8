"""What runs beside the conversations: a heartbeat while a server is slow, periodic /metrics scrapes (so a server
that restarted and grew past its old counters is still caught), and the records both leave in the run folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from blackbox.errors import BlackboxError
from blackbox.secrets import Redactor

__all__ = ["Heartbeat", "Watch", "stderr_line"]


def stderr_line(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class Scrapable(Protocol):
    arm: str

    async def metrics(self) -> Any: ...


class Heartbeat:
    """Requests in flight; every `every_s` seconds while the oldest has waited that long, one line naming it.
    One line per beat for the whole run, not one per request, so a slow fleet does not flood the terminal."""

    def __init__(self, every_s: float, write: Callable[[str], None] = stderr_line) -> None:
        self.every_s = every_s
        self.write = write
        self._ids = itertools.count()
        self._inflight: dict[int, tuple[str, str, float, float]] = {}  # id -> server, request, started, timeout

    @contextlib.contextmanager
    def waiting(self, server: str, request: str, timeout_s: float) -> Iterator[None]:
        key = next(self._ids)
        self._inflight[key] = (server, request, time.monotonic(), timeout_s)
        try:
            yield
        finally:
            del self._inflight[key]

    def beat(self) -> str | None:
        """The line for the oldest request in flight, if it has waited at least `every_s`; else None."""
        if not self._inflight:
            return None
        server, request, started, timeout = min(self._inflight.values(), key=lambda v: v[2])
        waited = time.monotonic() - started
        if waited < self.every_s:
            return None
        more = len(self._inflight) - 1
        return f"blackbox: still waiting on {server} for {request}: {waited:.0f} s so far (timeout {timeout:g} s)" + (
            f"; {more} more request{'s' if more != 1 else ''} in flight" if more else ""
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            line = self.beat()
            if line:
                self.write(line)


@dataclass
class Watch:
    """Per-run hooks the endpoints report to. Defaults are inert, so an `Endpoint` works without a run."""

    heartbeat: Heartbeat | None = None
    scrape_s: float = 0.0  # 0: no periodic scrapes
    redact: Redactor = field(default_factory=Redactor)
    on_retry: Callable[[Mapping[str, Any]], None] = lambda record: None
    on_scrape: Callable[[str, Mapping[str, Any]], None] = lambda arm, record: None
    started: float = field(default_factory=time.monotonic)

    def since_start(self) -> float:
        return time.monotonic() - self.started

    @contextlib.contextmanager
    def waiting(self, server: str, request: str, timeout_s: float) -> Iterator[None]:
        if self.heartbeat is None:
            yield
            return
        with self.heartbeat.waiting(server, request, timeout_s):
            yield

    @contextlib.asynccontextmanager
    async def running(self, endpoints: Iterable[Scrapable]) -> AsyncIterator[None]:
        """The heartbeat and the periodic scrapes, for as long as the block runs."""
        tasks = []
        if self.heartbeat is not None:
            tasks.append(asyncio.create_task(self.heartbeat.run()))
        if self.scrape_s > 0:
            tasks.extend(asyncio.create_task(self._scrape(e)) for e in endpoints)
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _scrape(self, endpoint: Scrapable) -> None:
        while True:
            await asyncio.sleep(self.scrape_s)
            # A failed scrape is recorded and the run goes on: the settled scrape at the end decides whether
            # /metrics is gone for good, and a restart shows in the next scrape that succeeds.
            try:
                await endpoint.metrics()
            except BlackboxError:
                pass  # the endpoint recorded it
            except Exception as exc:  # never let the scrapes stop silently
                error = self.redact(f"{type(exc).__name__}: {exc}")[:200]
                self.on_scrape(endpoint.arm, {"at": round(self.since_start(), 3), "error": error})
