"""Reading a server's release and cache settings, against httpx.MockTransport; and the hint built from them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx
import pytest

from blackbox.metrics import parse
from blackbox.server_info import (
    ServerInfo,
    missing_trigger_flags,
    parse_version,
    server_info,
    trigger_hint,
    trigger_setting_problems,
)

BASE = "http://127.0.0.1:8400"


def metrics_text(**labels: str) -> str:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{body}}} 1.0\n"
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0"} 0.0\n'
    )


CURRENT = {
    "block_size": "128",
    "enable_prefix_caching": "True",
    "mamba_cache_mode": "align",
    "prefix_cache_retention_interval": "None",
    "engine": "0",
}
# vLLM 0.28 publishes its CacheConfig without the retention field: the flag did not exist yet.
OLD = {k: v for k, v in CURRENT.items() if k != "prefix_cache_retention_interval"}


def client(routes: Mapping[str, httpx.Response | Exception], seen: list[str] | None = None) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.raw_path.decode()
        if seen is not None:
            seen.append(path)
        answer = routes.get(path, httpx.Response(404, text="Not Found"))
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.AsyncClient(base_url=BASE, transport=httpx.MockTransport(handle))


def version(v: str) -> httpx.Response:
    return httpx.Response(200, json={"version": v})


async def read(routes: Mapping[str, httpx.Response | Exception], **kw: Any) -> ServerInfo:
    async with client(routes) as http:
        return await server_info(http, **kw)


async def test_a_current_server_tells_its_release_and_cache_settings() -> None:
    info = await read({"/version": version("0.32.0"), "/metrics": httpx.Response(200, text=metrics_text(**CURRENT))})
    assert info.version == "0.32.0" and info.release == (0, 32, 0)
    assert info.settings["mamba_cache_mode"] == "align"
    assert info.settings["prefix_cache_retention_interval"] == "None"
    assert "engine" not in info.settings
    assert info.sources == ("vllm:cache_config_info",)
    assert info.url == BASE
    assert missing_trigger_flags(info.version, info) == []
    assert trigger_hint(info) == ""
    assert ServerInfo.from_json(json.loads(json.dumps(info.to_json()))) == info


async def test_a_snapshot_already_read_is_used_instead_of_a_second_metrics_request() -> None:
    seen: list[str] = []
    async with client({"/version": version("0.32.0")}, seen) as http:
        info = await server_info(http, parse(metrics_text(**CURRENT)))
    assert "/metrics" not in seen
    assert info.settings["block_size"] == "128"


async def test_a_release_without_the_retention_flag_is_named_in_the_hint() -> None:
    info = await read({"/version": version("0.28.0"), "/metrics": httpx.Response(200, text=metrics_text(**OLD))})
    assert missing_trigger_flags(info.version, info) == ["--prefix-cache-retention-interval"]
    hint = trigger_hint(info)
    assert "vLLM 0.28.0 has no --prefix-cache-retention-interval (added in 0.29.0)" in hint
    assert "VLLM_PREFIX_CACHE_RETENTION_INTERVAL unset" in hint


def test_by_release_number_alone_each_flag_is_missing_before_its_release() -> None:
    assert missing_trigger_flags("0.14.0") == ["--mamba-cache-mode", "--prefix-cache-retention-interval"]
    assert missing_trigger_flags("0.22.0") == ["--prefix-cache-retention-interval"]
    assert missing_trigger_flags("0.28.9") == ["--prefix-cache-retention-interval"]
    assert missing_trigger_flags("0.29.0") == []
    assert missing_trigger_flags("0.33.1") == []
    assert missing_trigger_flags(None) == []  # nothing known, nothing claimed
    hint = trigger_hint(ServerInfo(BASE, "0.14.0"))
    assert "has no --mamba-cache-mode (added in 0.16.0): upgrade to vLLM 0.16.0 or later" in hint
    # Before 0.23 there was no variable either: the only way is to upgrade.
    assert "has no --prefix-cache-retention-interval (added in 0.29.0): upgrade to vLLM 0.29.0" in hint


def test_published_settings_outrank_the_version_string() -> None:
    # A development build numbered below 0.29 that already has the field.
    dev = ServerInfo(BASE, "0.28.1.dev12+g0123abc", dict(CURRENT))
    assert missing_trigger_flags(dev.version, dev) == []
    # A build numbered 0.29 whose CacheConfig lacks it (a fork): the server's word wins.
    fork = ServerInfo(BASE, "0.29.0", dict(OLD))
    assert missing_trigger_flags(fork.version, fork) == ["--prefix-cache-retention-interval"]


def test_settings_that_work_against_the_trigger_are_named() -> None:
    info = ServerInfo(
        BASE,
        "0.32.0",
        {
            **CURRENT,
            "mamba_cache_mode": "none",
            "prefix_cache_retention_interval": "0",
            "enable_prefix_caching": "False",
        },
    )
    problems = trigger_setting_problems(info)
    assert problems == [
        "prefix caching is off: start it with --enable-prefix-caching",
        "--mamba-cache-mode is none: start it with --mamba-cache-mode align",
        "--prefix-cache-retention-interval is 0, so checkpoints written during decode are dropped: "
        "start it with --prefix-cache-retention-interval None",
    ]
    assert trigger_hint(info) == "; ".join(problems)
    old_env = ServerInfo(BASE, "0.27.1", {**OLD, "VLLM_PREFIX_CACHE_RETENTION_INTERVAL": "0"})
    assert "VLLM_PREFIX_CACHE_RETENTION_INTERVAL=0 drops decode-written checkpoints" in trigger_hint(old_env)


async def test_server_info_in_dev_mode_adds_the_step_budget_and_drafter() -> None:
    dev = {
        "vllm_config": {
            "cache_config": {"block_size": 128, "mamba_cache_mode": "align", "prefix_cache_retention_interval": None},
            "scheduler_config": {"max_num_batched_tokens": 96, "max_num_seqs": 8},
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 2, "draft_model_config": {}},
        },
        "vllm_env": {"VLLM_PREFIX_CACHE_RETENTION_INTERVAL": None},
    }
    info = await read(
        {
            "/version": version("0.32.0"),
            "/metrics": httpx.Response(200, text=metrics_text(**CURRENT)),
            "/server_info?config_format=json": httpx.Response(200, json=dev),
        }
    )
    assert info.sources == ("vllm:cache_config_info", "/server_info")
    assert info.settings["max_num_batched_tokens"] == "96"
    assert info.settings["speculative_method"] == "mtp"
    assert info.settings["prefix_cache_retention_interval"] == "None"
    assert trigger_hint(info) == ""


@pytest.mark.parametrize(
    ("routes", "note"),
    [
        ({}, "/version: HTTP 404"),
        ({"/version": httpx.Response(200, text="<html>")}, "/version: no version"),
        ({"/version": httpx.ConnectError("refused")}, "/version: ConnectError: refused"),
        ({"/version": version("0.32.0"), "/metrics": httpx.Response(200, text="not { prometheus")}, "/metrics:"),
        ({"/version": version("0.32.0"), "/metrics": httpx.Response(200, text="")}, "no vllm:cache_config_info"),
    ],
)
async def test_a_server_that_tells_less_gives_notes_not_exceptions(
    routes: Mapping[str, httpx.Response | Exception], note: str
) -> None:
    info = await read(routes)
    assert any(note in n for n in info.notes), info.notes
    assert not info.settings
    assert trigger_hint(info) == ""  # a server that tells nothing is not claimed to lack anything


def test_versions_parse_as_vllm_writes_them() -> None:
    assert parse_version("0.29.0") == (0, 29, 0)
    assert parse_version("v0.32.0+cpu") == (0, 32, 0)
    assert parse_version("0.29.1.dev12+gabc") == (0, 29, 1)
    assert parse_version("0.8") == (0, 8, 0)
    assert parse_version("dev") is None
    assert parse_version(None) is None
