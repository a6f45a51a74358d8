"""The probe registry and the shape of the package: every probe behind one interface, no import circle."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import pytest
from fake_server import FakeVLLM

from blackbox import config, metrics, probes
from blackbox.client import Endpoint
from blackbox.errors import EndpointError, UsageError
from blackbox.geometry import Geometry
from blackbox.history import Arm
from blackbox.metrics import MetricsSnapshot
from blackbox.probes import base
from blackbox.probes.base import Probe
from blackbox.probes.multiturn import _multiturn
from blackbox.workload import plan_conversation

PACKAGE = Path(__file__).resolve().parent.parent / "blackbox"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, every import counted (under TYPE_CHECKING and inside
    functions too: a circle hidden there still ties the modules together)."""
    modules = {_module(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}  # `from blackbox import gates`
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph(PACKAGE)
    assert "blackbox.probes.multiturn" in graph and "blackbox.engine" in graph
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_the_circle_finder_finds_a_circle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_registry_and_the_config_name_the_same_probes() -> None:
    assert tuple(probes.PROBES) == config.PROBES
    for name, probe in probes.PROBES.items():
        assert isinstance(probe, Probe) and probe.name == name and probe.about


def test_probe_all_expands_to_every_probe_in_place_and_repeats_are_dropped() -> None:
    assert probes.expand(["all"]) == tuple(n for n in probes.PROBES if n not in ("load", "preemption"))
    assert probes.expand(["cold-race", "all"])[0] == "cold-race"
    assert probes.expand(["multiturn", "multiturn"]) == ("multiturn",)
    with pytest.raises(UsageError, match="unknown probe 'nope'"):
        probes.expand(["nope"])


def test_probe_all_leaves_out_only_the_probes_that_need_servers_launched_for_them_and_says_why() -> None:
    """A deployment that cannot be relaunched small (a staging server) would read UNKNOWN on every --probe all."""
    assert set(probes.PROBES) - set(probes.IN_ALL) == {"load", "preemption"}
    assert "but load (it needs both arms served with a small KV cache" in probes.all_help()
    assert "preemption (it needs both arms served with a KV cache too small for its turn 1s" in probes.all_help()


def test_selected_runs_in_registry_order() -> None:
    assert [p.name for p in probes.selected(["cold-race", "multiturn"])] == ["multiturn", "cold-race"]


def test_the_cli_takes_probe_all_and_repeats() -> None:
    from blackbox import cli

    def probes_of(*argv: str) -> tuple[str, ...]:
        args = cli._parser().parse_args(["run", "--treatment", "http://t", *argv])
        return cli._config(args, {"treatment": args.treatment, "control": None}, None).probes

    assert probes_of() == ("multiturn",)
    assert probes_of("--probe", "all") == probes.IN_ALL
    assert probes_of("--probe", "all", "--probe", "load") == (*probes.IN_ALL, "load")
    assert probes_of("--probe", "held-prefix", "--probe", "cold-race") == ("held-prefix", "cold-race")


class _Counting:
    """An endpoint whose cache-hit counter moves on the scrapes listed, then holds still."""

    def __init__(self, moves_on: set[int]) -> None:
        self.scrapes, self.hits, self.moves_on = 0, 0.0, moves_on

    async def metrics(self) -> MetricsSnapshot:
        self.scrapes += 1
        if self.scrapes in self.moves_on:
            self.hits += 16
        return MetricsSnapshot({(metrics.CACHE_HITS, ()): self.hits})


def test_settle_waits_out_a_counter_that_moves_and_returns_its_last_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "SETTLE_POLL_S", 0.0)
    endpoint = _Counting({2, 4})
    got = asyncio.run(base.settle(endpoint, limit_s=5.0))  # type: ignore[arg-type]
    assert got.value(metrics.CACHE_HITS) == 32
    assert endpoint.scrapes == 4 + base.SETTLE_STABLE  # the last move, then that many unchanged in a row


def test_settle_gives_up_at_its_limit_on_a_counter_that_never_stops() -> None:
    endpoint = _Counting(set(range(1, 10_000)))
    got = asyncio.run(base.settle(endpoint, limit_s=0.35))  # type: ignore[arg-type]
    assert got.value(metrics.CACHE_HITS) == 16 * endpoint.scrapes  # the last scrape's, still moving


def _logged(ep: Endpoint, events: list[str]) -> Endpoint:
    """`ep`, noting each prompt sized ("size") and each chat request ("chat CONVERSATION KIND") in `events`."""
    count, chat = ep.count_tokens, ep.chat

    async def counted(messages: Any, **kw: Any) -> int:
        events.append("size")
        return await count(messages, **kw)

    async def chatted(body: Any, **kw: Any) -> Any:
        events.append(f"chat {kw['conversation']} {kw['kind']}")
        return await chat(body, **kw)

    ep.count_tokens, ep.chat = counted, chatted  # type: ignore[method-assign]
    return ep


def _pair_config(urls: dict[str, str]) -> config.RunConfig:
    return config.RunConfig(
        treatment=urls[Arm.TREATMENT],
        control=urls[Arm.CONTROL],
        reference=urls[Arm.REFERENCE],
        conversations=6,
        concurrency=2,
    )


def test_the_multiturn_probe_sizes_prompts_beside_its_conversations_not_all_first() -> None:
    """Sized all first, the servers sat idle while ~10 /tokenize calls a prompt ran for every conversation. Now
    the first turn 1 goes out before the last prompt is sized, and the plans are the ones sizing alone gives."""
    events: list[str] = []

    async def drive(urls: dict[str, str]) -> tuple[list[Any], list[Any], list[Any], list[Any], list[str]]:
        endpoints = {arm: _logged(Endpoint(arm, url), events) for arm, url in urls.items()}
        for ep in endpoints.values():
            await ep.ready()
        cfg = _pair_config(urls)
        geo = Geometry(16, "test", 4096)
        try:
            own, extras, exchanges = await _multiturn(cfg, endpoints, geo, "salt", lambda e: e, lambda *_: None)
            during = list(events)
            alone = [
                await plan_conversation(p.index, cfg.seed, cfg.shape, 16, 4096, endpoints[Arm.TREATMENT].count_tokens)
                for p in (*own, *extras)
            ]
        finally:
            await asyncio.gather(*(e.aclose() for e in endpoints.values()))
        return own, extras, exchanges, alone, during

    with FakeVLLM() as t, FakeVLLM(caching=False) as c, FakeVLLM(speculative=False) as r:
        own, extras, exchanges, alone, during = asyncio.run(
            drive({Arm.TREATMENT: t.url, Arm.CONTROL: c.url, Arm.REFERENCE: r.url})
        )
    chats = [i for i, e in enumerate(during) if e.startswith("chat")]
    sizes = [i for i, e in enumerate(during) if e == "size"]
    assert chats and sizes and chats[0] < sizes[-1], "every prompt was sized before the first turn 1 went out"
    assert [p.index for p in own] == list(range(6)) and len(extras) == 6
    assert [*own, *extras] == alone
    assert all(e.ok for e in exchanges)


def test_a_prompt_that_cannot_be_sized_is_raised_once_no_conversation_is_left_sending() -> None:
    """Sizing runs beside the conversations now: when a later prompt's /tokenize fails, the conversations already
    under way finish, the error is raised after them, and nothing is sent once it has been."""
    events: list[str] = []

    async def drive(urls: dict[str, str]) -> int:
        endpoints = {arm: _logged(Endpoint(arm, url), events) for arm, url in urls.items()}
        count, calls = endpoints[Arm.TREATMENT].count_tokens, 0

        async def failing(messages: Any, **kw: Any) -> int:
            nonlocal calls
            calls += 1
            if calls > 40:  # about the fifth prompt on: the first ones are being sent by then
                raise EndpointError("treatment: POST /tokenize failed: test")
            return await count(messages, **kw)

        endpoints[Arm.TREATMENT].count_tokens = failing  # type: ignore[method-assign]
        try:
            for ep in endpoints.values():
                await ep.ready()
            with pytest.raises(EndpointError, match="POST /tokenize failed: test"):
                await _multiturn(
                    _pair_config(urls), endpoints, Geometry(16, "t", 4096), "s", lambda e: e, lambda *_: None
                )
            raised = len(events)
            await asyncio.sleep(0.5)  # time for a conversation left running to send its next request
            return raised
        finally:
            await asyncio.gather(*(e.aclose() for e in endpoints.values()))

    with FakeVLLM() as t, FakeVLLM(caching=False) as c, FakeVLLM(speculative=False) as r:
        raised = asyncio.run(drive({Arm.TREATMENT: t.url, Arm.CONTROL: c.url, Arm.REFERENCE: r.url}))
    assert any(e.startswith("chat") for e in events[:raised]), "no conversation had started: nothing was tested"
    assert events[raised:] == [], "a conversation went on sending after the error was raised"
