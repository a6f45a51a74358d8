"""Prometheus counters from `/metrics`: snapshots, settled deltas, and the labels vLLM publishes its config in.

vLLM updates counters after the response is sent, so a delta is read only once the counters stop moving.
A counter that went backwards means the server restarted mid-run: that is `CounterReset`, never a zero delta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from blackbox.errors import CounterReset, EndpointError

__all__ = [
    "ACCEPTED",
    "CACHE_HITS",
    "CACHE_QUERIES",
    "DRAFTS",
    "DRAFT_TOKENS",
    "MetricsDelta",
    "MetricsSnapshot",
    "combine",
    "parse",
]

CACHE_QUERIES = "vllm:prefix_cache_queries"
CACHE_HITS = "vllm:prefix_cache_hits"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
CACHE_CONFIG_INFO = "vllm:cache_config_info"

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MetricsSnapshot:
    """Counter and gauge samples keyed by (name without `_total`, sorted labels), plus info labels."""

    samples: Mapping[tuple[str, Labels], float]
    info: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    counters: frozenset[str] = frozenset()
    text: str = ""

    def value(self, name: str, **labels: str) -> float | None:
        """Sum over every series of `name` whose labels include `labels`; None when absent."""
        want = set(labels.items())
        hits = [v for (n, ls), v in self.samples.items() if n == name and want <= set(ls)]
        return sum(hits) if hits else None

    def per_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, ls), v in self.samples.items():
            if n == name:
                key = dict(ls).get(label)
                if key is not None:
                    out[key] = out.get(key, 0.0) + v
        return out


@dataclass(frozen=True)
class MetricsDelta:
    """after - before, per series. Absent series read as None, not 0, so "no metric" is not "no activity"."""

    before: MetricsSnapshot
    after: MetricsSnapshot

    def value(self, name: str, **labels: str) -> float | None:
        a = self.after.value(name, **labels)
        if a is None:
            return None
        b = self.before.value(name, **labels) or 0.0
        return a - b

    def per_label(self, name: str, label: str) -> dict[str, float]:
        before = self.before.per_label(name, label)
        return {k: v - before.get(k, 0.0) for k, v in self.after.per_label(name, label).items()}

    def check_monotonic(self, arm: str) -> None:
        for key, b in self.before.samples.items():
            a = self.after.samples.get(key)
            if key[0] in self.after.counters and a is not None and a < b:
                raise CounterReset(
                    f"{arm}: counter {key[0]} went backwards ({b:g} -> {a:g}): the server restarted mid-run",
                    hint="check the server log for a crash or restart, then re-run",
                )


def combine(snapshots: Sequence[MetricsSnapshot]) -> MetricsSnapshot:
    """Replicas behind one router as one server: counters summed per series, config labels from the first."""
    samples: dict[tuple[str, Labels], float] = {}
    for snap in snapshots:
        for key, value in snap.samples.items():
            samples[key] = samples.get(key, 0.0) + value
    info = snapshots[0].info if snapshots else {}
    counters = frozenset().union(*(s.counters for s in snapshots))
    return MetricsSnapshot(samples, info, counters, "".join(s.text for s in snapshots))


def parse(text: str) -> MetricsSnapshot:
    samples: dict[tuple[str, Labels], float] = {}
    info: dict[str, dict[str, str]] = {}
    counters: set[str] = set()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise EndpointError(f"/metrics is not Prometheus text: {exc}", hint="is this a vLLM server?") from exc
    for family in families:
        if family.type == "counter":
            counters.add(family.name)
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            name = s.name.removesuffix("_total")
            samples[(name, tuple(sorted(s.labels.items())))] = float(s.value)
            if family.type in ("info", "gauge") and s.name.endswith("_info"):
                info[s.name] = dict(s.labels)
    return MetricsSnapshot(samples, info, frozenset(counters), text)
