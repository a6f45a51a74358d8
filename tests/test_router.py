"""A deployment behind a router: several replicas' /metrics summed stand for the one treatment endpoint."""

from __future__ import annotations

import httpx

from blackbox import metrics
from blackbox.client import Endpoint

import histories as h


async def test_replica_metrics_are_summed() -> None:
    pages = {
        "http://127.0.0.2:9000/metrics": h.prom({metrics.CACHE_HITS: 100, metrics.DRAFTS: 7}),
        "http://127.0.0.3:9000/metrics": h.prom({metrics.CACHE_HITS: 250, metrics.DRAFTS: 3}),
    }
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text=pages[str(request.url)])

    # No request leaves the process: the transport answers from `pages`.
    async with Endpoint(
        "treatment", "http://127.0.0.1:8000", metrics_urls=tuple(pages), transport=httpx.MockTransport(answer)
    ) as endpoint:
        snap = await endpoint.metrics()
    assert seen == list(pages)
    assert snap.value(metrics.CACHE_HITS) == 350
    assert snap.value(metrics.DRAFTS) == 10
    assert snap.info[metrics.CACHE_CONFIG_INFO]["block_size"] == "16"


def test_combining_one_snapshot_changes_nothing() -> None:
    one = h.snapshot({metrics.CACHE_HITS: 5})
    assert metrics.combine([one]).samples == one.samples
