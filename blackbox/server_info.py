"""What a vLLM server says about itself: its release (`GET /version`) and the cache settings it runs with.

Settings come from the labels of `vllm:cache_config_info` on `/metrics` (every server) and, where the server
offers it (`VLLM_SERVER_DEV_MODE=1`), from `/server_info?config_format=json`. Nothing here raises for a server
that tells less: a missing source becomes a note, so the verdict can still say what it could not check.

`missing_trigger_flags` and `trigger_hint` turn that into the `TriggerNotExercised` hint: which flag the
trigger needs that this release does not have, and which setting the server runs with works against it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from blackbox.metrics import CACHE_CONFIG_INFO, MetricsSnapshot, parse

__all__ = [
    "FLAG_SINCE",
    "ServerInfo",
    "missing_trigger_flags",
    "parse_version",
    "server_info",
    "trigger_hint",
    "trigger_setting_problems",
]

# The first release whose CLI has each flag the treatment needs, read from the `vllm` sdists on PyPI
# (vllm/engine/arg_utils.py): `--mamba-cache-mode` is absent from 0.14.0 and present from 0.16.0 (0.15.0 has no
# sdist); `--prefix-cache-retention-interval` is absent from 0.28.0 and present in 0.29.0 (PR #52216 promoted the
# `VLLM_PREFIX_CACHE_RETENTION_INTERVAL` variable, which 0.23.0-0.28.0 read, to a flag).
FLAG_SINCE: Mapping[str, tuple[int, int, int]] = {
    "--mamba-cache-mode": (0, 16, 0),
    "--prefix-cache-retention-interval": (0, 29, 0),
}

# The CacheConfig field behind each flag: a server that publishes the field has the flag, whatever its version
# string says (a dev build between two releases).
_FIELD = {
    "--mamba-cache-mode": "mamba_cache_mode",
    "--prefix-cache-retention-interval": "prefix_cache_retention_interval",
}

# Before the flag existed, this variable set the retention (unset: every checkpoint kept).
_RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
_RETENTION_ENV_SINCE = (0, 23, 0)


@dataclass(frozen=True)
class ServerInfo:
    """`settings` maps a CacheConfig/SchedulerConfig field name to its value as text ("None", "align", "96")."""

    url: str
    version: str | None
    settings: Mapping[str, str] = field(default_factory=dict)
    sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def release(self) -> tuple[int, int, int] | None:
        return parse_version(self.version)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "version": self.version,
            "settings": dict(self.settings),
            "sources": list(self.sources),
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServerInfo:
        """Read back what `to_json` wrote (a run folder's record), so a re-judged run gives the same hint."""
        return cls(
            str(data["url"]),
            data.get("version"),
            {str(k): str(v) for k, v in (data.get("settings") or {}).items()},
            tuple(data.get("sources") or ()),
            tuple(data.get("notes") or ()),
        )


def parse_version(text: str | None) -> tuple[int, int, int] | None:
    """`0.29.0`, `0.29.1.dev12+gabc`, `v0.32.0+cpu` -> (major, minor, patch); None when unreadable."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", (text or "").strip())
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


async def server_info(http: httpx.AsyncClient, snapshot: MetricsSnapshot | None = None) -> ServerInfo:
    """Read `/version`, the cache labels (from `snapshot` when the caller already read `/metrics`) and, where
    offered, `/server_info`. `http` carries the base URL and any API key."""
    notes: list[str] = []
    version = await _version(http, notes)
    settings: dict[str, str] = {}
    sources: list[str] = []
    labels = await _cache_labels(http, snapshot, notes)
    if labels:
        settings.update({k: v for k, v in labels.items() if k != "engine"})
        sources.append(CACHE_CONFIG_INFO)
    dev = await _dev_settings(http)
    if dev:
        settings.update(dev)
        sources.append("/server_info")
    return ServerInfo(str(http.base_url).rstrip("/"), version, settings, tuple(sources), tuple(notes))


async def _get(http: httpx.AsyncClient, path: str, notes: list[str] | None) -> httpx.Response | None:
    try:
        response = await http.get(path)
    except httpx.HTTPError as exc:
        if notes is not None:
            notes.append(f"{path}: {type(exc).__name__}: {exc}")
        return None
    if response.status_code != 200:
        if notes is not None:
            notes.append(f"{path}: HTTP {response.status_code}")
        return None
    return response


async def _version(http: httpx.AsyncClient, notes: list[str]) -> str | None:
    response = await _get(http, "/version", notes)
    if response is None:
        return None
    try:
        value = response.json().get("version")
    except (ValueError, AttributeError):
        value = None
    if not isinstance(value, str) or not value:
        notes.append(f"/version: no version in {response.text[:100]!r}")
        return None
    return value


async def _cache_labels(
    http: httpx.AsyncClient, snapshot: MetricsSnapshot | None, notes: list[str]
) -> Mapping[str, str]:
    if snapshot is None:
        response = await _get(http, "/metrics", notes)
        if response is None:
            return {}
        try:
            snapshot = parse(response.text)
        except Exception as exc:  # EndpointError from a body that is not Prometheus text
            notes.append(f"/metrics: {exc}")
            return {}
    labels = snapshot.info.get(CACHE_CONFIG_INFO, {})
    if not labels:
        notes.append(f"/metrics: no {CACHE_CONFIG_INFO}")
    return labels


async def _dev_settings(http: httpx.AsyncClient) -> dict[str, str]:
    """Only a server started with `VLLM_SERVER_DEV_MODE=1` answers; its absence is normal, so no note."""
    response = await _get(http, "/server_info?config_format=json", None)
    if response is None:
        return {}
    try:
        data = response.json()
    except ValueError:
        return {}
    config = data.get("vllm_config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        return {}
    out: dict[str, str] = {}
    for section, names in _DEV_FIELDS.items():
        values = config.get(section)
        if isinstance(values, dict):
            out.update({name: str(values[field]) for field, name in names.items() if field in values})
    spec = config.get("speculative_config")
    if isinstance(spec, dict):
        out.update({f"speculative_{k}": str(spec[k]) for k in ("method", "num_speculative_tokens") if k in spec})
    env = data.get("vllm_env")
    if isinstance(env, dict):
        out.update({name: str(env[name]) for name in _DEV_ENV if name in env})
    return out


def _fields(*names: str, prefix: str = "") -> dict[str, str]:
    return {n: f"{prefix}{n}" for n in names}


# /server_info section -> {field: setting name}. Cache and scheduler fields keep their own names (those of the
# `vllm:cache_config_info` labels); fields whose names recur across sections take the section's as a prefix.
_DEV_FIELDS: Mapping[str, Mapping[str, str]] = {
    "cache_config": _fields(
        "enable_prefix_caching", "mamba_cache_mode", "prefix_cache_retention_interval", "block_size",
        "cache_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_block_size",
        "enable_mamba_shared_prefix_checkpoint", "use_replayssm", "replayssm_buffer_len", "num_gpu_blocks",
    ),
    "scheduler_config": _fields(
        "max_num_batched_tokens", "max_num_scheduled_tokens", "max_num_seqs", "enable_chunked_prefill",
        "long_prefill_token_threshold", "max_num_partial_prefills", "max_long_partial_prefills", "policy",
        "async_scheduling",
    ),
    "model_config": _fields("dtype", "quantization", "logprobs_mode", "enforce_eager", "disable_cascade_attn"),
    "parallel_config": _fields(
        "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
        "prefill_context_parallel_size", "decode_context_parallel_size",
    ),
    "compilation_config": _fields("mode", "cudagraph_mode", "backend", prefix="compilation."),
    "attention_config": _fields("backend", prefix="attention."),
    "mamba_config": _fields("backend", prefix="mamba."),
    "kernel_config": _fields("moe_backend", "linear_backend", prefix="kernel."),
}  # fmt: skip
_DEV_ENV = (
    _RETENTION_ENV,
    "VLLM_BATCH_INVARIANT",
    "VLLM_ATTENTION_BACKEND",
    "VLLM_FLOAT32_MATMUL_PRECISION",
    "VLLM_GDN_DECODE_KERNEL",
    "VLLM_SSM_CONV_STATE_LAYOUT",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
)


def missing_trigger_flags(version: str | None, info: ServerInfo | None = None) -> list[str]:
    """The flags the trigger needs that this server's release does not have. The server's own settings decide
    where it publishes them; otherwise the release number does; with neither, nothing is claimed missing."""
    settings = info.settings if info is not None else {}
    release = parse_version(version if version is not None else (info.version if info is not None else None))
    published = "block_size" in settings  # the server told its cache config, so an absent field is absent
    missing = []
    for flag, since in FLAG_SINCE.items():
        has = _FIELD[flag] in settings if published else release is None or release >= since
        if not has:
            missing.append(flag)
    return missing


def trigger_setting_problems(info: ServerInfo) -> list[str]:
    """Settings the treatment runs with that keep turn-2 hits from reaching decode-written blocks."""
    s = info.settings
    problems = []
    if s.get("enable_prefix_caching", "").lower() == "false":
        problems.append("prefix caching is off: start it with --enable-prefix-caching")
    mode = s.get("mamba_cache_mode")
    if mode is not None and mode != "align":
        problems.append(f"--mamba-cache-mode is {mode}: start it with --mamba-cache-mode align")
    retention = s.get("prefix_cache_retention_interval")
    if retention is not None and retention != "None":
        problems.append(
            f"--prefix-cache-retention-interval is {retention}, so checkpoints written during decode are dropped: "
            "start it with --prefix-cache-retention-interval None"
        )
    env = s.get(_RETENTION_ENV)
    if retention is None and env not in (None, "None", ""):
        problems.append(f"{_RETENTION_ENV}={env} drops decode-written checkpoints: unset it")
    return problems


def trigger_hint(info: ServerInfo) -> str:
    """One sentence for the `TriggerNotExercised` hint; empty when the server told nothing that explains it."""
    parts = []
    where = f"vLLM {info.version}" if info.version else "this server"
    for flag in missing_trigger_flags(info.version, info):
        since = ".".join(map(str, FLAG_SINCE[flag]))
        part = f"{where} has no {flag} (added in {since})"
        release = info.release
        if flag == "--prefix-cache-retention-interval" and release is not None and release >= _RETENTION_ENV_SINCE:
            part += f": leave {_RETENTION_ENV} unset (keeps every checkpoint) or upgrade"
        else:
            part += f": upgrade to vLLM {since} or later"
        parts.append(part)
    parts.extend(trigger_setting_problems(info))
    return "; ".join(parts)
