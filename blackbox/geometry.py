"""The server's cache geometry, read over HTTP."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from blackbox.errors import GeometryUnsupported
from blackbox.metrics import CACHE_CONFIG_INFO, MetricsSnapshot

__all__ = ["Geometry", "discover"]


@dataclass(frozen=True)
class Geometry:
    block_size: int
    block_size_source: str
    max_model_len: int


def discover(snapshot: MetricsSnapshot, max_model_len: int | None, override: int | None) -> Geometry:
    """Block size from `vllm:cache_config_info{block_size}` (the resolved hybrid size; the `mamba_block_size`
    label can be stale), unless overridden."""
    if max_model_len is None:
        raise GeometryUnsupported(
            "/v1/models reports no max_model_len",
            hint="is this a vLLM server? blackbox needs it to size prompts",
        )
    if override is not None:
        return Geometry(override, "--block-size", max_model_len)
    label = snapshot.info.get(CACHE_CONFIG_INFO, {}).get("block_size")
    if label is None or not label.isdigit() or int(label) <= 0:
        raise GeometryUnsupported(
            f"cannot read the block size: {CACHE_CONFIG_INFO} has block_size={label!r}",
            hint="pass --block-size N (the server log says 'Setting attention block size to N tokens')",
        )
    return Geometry(int(label), f"{CACHE_CONFIG_INFO}", max_model_len)


def prefix_caching(snapshot: MetricsSnapshot) -> bool | None:
    labels: Mapping[str, str] = snapshot.info.get(CACHE_CONFIG_INFO, {})
    value = labels.get("enable_prefix_caching")
    return None if value is None else value.lower() == "true"
