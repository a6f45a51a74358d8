"""The real CPU pair exercises the code path blackbox exists for (vLLM CPU, tiny hybrid model)."""

from __future__ import annotations

import asyncio

import httpx

from blackbox import metrics
from blackbox.client import Endpoint
from blackbox.geometry import prefix_caching
from blackbox.history import Exchange, Plan
from blackbox.workload import Shape, plan_conversation, turn1_body, turn2_body, turn2_messages
from servers.launch import Fleet


def _snapshot(url: str) -> metrics.MetricsSnapshot:
    return metrics.parse(httpx.get(f"{url}/metrics", timeout=10).text)


def test_servers_are_healthy_and_expose_their_roles(cpu_fleet: Fleet) -> None:
    for url in cpu_fleet.urls.values():
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    treatment, control = _snapshot(cpu_fleet.urls["treatment"]), _snapshot(cpu_fleet.urls["control"])
    reference = _snapshot(cpu_fleet.urls["reference"])
    assert prefix_caching(treatment) is True
    assert prefix_caching(control) is False
    assert prefix_caching(reference) is True
    for name in (metrics.CACHE_QUERIES, metrics.CACHE_HITS, metrics.DRAFTS, metrics.ACCEPTED):
        assert treatment.value(name) is not None, name
    assert reference.value(metrics.DRAFTS) is None, "the reference must run without speculative decoding"
    assert treatment.info[metrics.CACHE_CONFIG_INFO]["block_size"] == "128"


def test_two_roles_share_one_device_and_both_serve(cpu_fleet: Fleet) -> None:
    # On a 2-core machine the launcher puts three roles on two cores: two of them share one, as several roles
    # share one GPU on a GPU host. Both must be healthy and answer.
    binds = {s.role: s.env.get("VLLM_CPU_OMP_THREADS_BIND") for s in cpu_fleet.specs}
    shared = [role for role, core in binds.items() if list(binds.values()).count(core) > 1]
    assert len(shared) >= 2, binds
    for role in shared:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "the code of amber"}], "max_tokens": 4}
        reply = httpx.post(f"{cpu_fleet.urls[role]}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1, (role, reply.text)


async def _settled(url: str, before: metrics.MetricsSnapshot) -> metrics.MetricsDelta:
    async with httpx.AsyncClient() as http:
        last = None
        for _ in range(60):
            snap = metrics.parse((await http.get(f"{url}/metrics")).text)
            if last is not None and snap.value(metrics.CACHE_HITS) == last.value(metrics.CACHE_HITS):
                return metrics.MetricsDelta(before, snap)
            last = snap
            await asyncio.sleep(0.5)
    raise AssertionError("counters never settled")


async def test_turn2_hit_reaches_decode_written_blocks(cpu_fleet: Fleet) -> None:
    """A boundary crossed inside an accepted draft gets no checkpoint (~84% of conversations reach the region
    on this pair), so four conversations run and at least one must reach it; the counter must match them all."""
    url = cpu_fleet.urls["treatment"]
    shape = Shape()
    async with Endpoint("treatment", url) as ep:
        await ep.ready()
        plans = [await plan_conversation(i, 1234, shape, 128, 4096, ep.count_tokens) for i in range(4)]
        before = await ep.metrics()

        async def conversation(plan: Plan) -> tuple[Exchange, Exchange]:
            salt = f"test-pair-decode-region-{plan.index}"
            turn1 = await ep.chat({**turn1_body(plan, shape), "cache_salt": salt}, conversation=0, kind="turn1")
            assert turn1.ok, turn1.error
            turn2 = await ep.chat(
                turn2_body(turn2_messages(plan, turn1.text), shape, salt=salt), conversation=0, kind="turn2"
            )
            assert turn2.ok, turn2.error
            return turn1, turn2

        pairs = await asyncio.gather(*(conversation(p) for p in plans))
    delta = await _settled(url, before)
    for plan, (turn1, _) in zip(plans, pairs, strict=True):
        assert turn1.completion_tokens == plan.turn1_max_tokens
        # Turn 1 decodes across block boundaries past its prompt.
        assert (plan.turn1_prompt_tokens + plan.turn1_max_tokens) // 128 > plan.turn1_prompt_tokens // 128 + 1
    reached = [
        t2.cached_tokens
        for plan, (_, t2) in zip(plans, pairs, strict=True)
        if t2.cached_tokens is not None and t2.cached_tokens >= plan.turn1_prompt_tokens + 128
    ]
    assert reached, [(p.turn1_prompt_tokens, t2.cached_tokens) for p, (_, t2) in zip(plans, pairs, strict=True)]
    cached = sum((t1.cached_tokens or 0) + (t2.cached_tokens or 0) for t1, t2 in pairs)
    assert delta.value(metrics.CACHE_HITS) == cached
    assert (delta.value(metrics.DRAFTS) or 0) > 0
    assert (delta.value(metrics.ACCEPTED) or 0) > 0
