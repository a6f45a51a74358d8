"""Prometheus counters from `/metrics`: snapshots, settled deltas, and the labels vLLM publishes its config in.

vLLM updates counters after the response is sent, so a delta is read only once the counters stop moving.
A restart mid-run is `CounterReset`, never a zero delta: a counter that went backwards between any two scrapes
(blackbox scrapes during the run too, so a restarted server that grew past its old values is still caught), a
changed `*_created` timestamp, or a changed `process_start_time_seconds`. Series without a `# TYPE` line count as
counters when named `*_total`; a histogram's `_count` is a counter too.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    "from_compact",
    "is_vllm",
    "parse",
    "restarts",
]

CACHE_QUERIES = "vllm:prefix_cache_queries"
CACHE_HITS = "vllm:prefix_cache_hits"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
PREEMPTIONS = "vllm:num_preemptions"
EVICTIONS = "vllm:kv_block_idle_before_evict_seconds_count"  # one sample per evicted block (--kv-cache-metrics)
START_TIME = "process_start_time_seconds"

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MetricsSnapshot:
    """Counter and gauge samples keyed by (name without `_total`, sorted labels), plus info labels."""

    samples: Mapping[tuple[str, Labels], float]
    info: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    counters: frozenset[str] = frozenset()
    text: str = ""
    created: Mapping[tuple[str, Labels], float] = field(default_factory=dict)  # `*_created`: when a series began
    at: float = 0.0  # seconds since the run's first scrape, for messages; 0 when not known

    def compact(self, with_created: bool = True) -> dict[str, Any]:
        """What restart detection needs, for `metrics/<arm>-scrapes.jsonl`: counters and start time, and the
        `_created` stamps when asked (they rarely change: a scrape without them keeps the previous ones)."""
        keep = [[n, dict(ls), v] for (n, ls), v in self.samples.items() if n in self.counters or n == START_TIME]
        out: dict[str, Any] = {"at": round(self.at, 3), "counters": sorted(self.counters), "samples": keep}
        if with_created:
            out["created"] = [[n, dict(ls), v] for (n, ls), v in self.created.items()]
        return out

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

    during: Sequence[MetricsSnapshot] = ()  # every scrape taken between (and around) the two, in order

    def check_monotonic(self, arm: str) -> None:
        # Every scrape in time order, stamped when its page arrived (`before` and `after` are among them, and
        # periodic scrapes go on while `after` is read, so list order is not time order). A run folder re-read
        # without its scrapes file has only the two .prom files, which carry no time.
        timeline = sorted(self.during, key=lambda snap: snap.at) if self.during else [self.before, self.after]
        found = restarts(timeline)
        if found:
            raise CounterReset(
                f"{arm}: {found[0]}: the server restarted mid-run"
                + (f" ({len(found) - 1} more signs of it)" if len(found) > 1 else ""),
                hint="check the server log for a crash or restart, then re-run",
            )


def restarts(scrapes: Sequence[MetricsSnapshot]) -> list[str]:
    """Every sign of a restart between consecutive scrapes, as sentences."""
    found: list[str] = []
    for prev, cur in itertools.pairwise(scrapes):
        when = f" (scrapes at {prev.at:.0f} s and {cur.at:.0f} s)" if cur.at else ""
        for key, b in prev.samples.items():
            a = cur.samples.get(key)
            if a is None:
                continue
            if key[0] in cur.counters and key[0] in prev.counters and a < b:
                found.append(f"counter {_series(key)} went backwards ({b:g} -> {a:g}){when}")
            elif key[0] == START_TIME and a != b:
                found.append(f"{START_TIME} changed ({b:.0f} -> {a:.0f}){when}")
        for key, b in prev.created.items():
            a = cur.created.get(key)
            if a is not None and a != b:
                found.append(f"{_series(key)}_created changed ({b:.0f} -> {a:.0f}){when}")
    return found


def _series(key: tuple[str, Labels]) -> str:
    name, labels = key
    shown = ",".join(f"{k}={v}" for k, v in labels if k not in ("engine", "model_name"))
    return f"{name}{{{shown}}}" if shown else name


def is_vllm(snapshot: MetricsSnapshot) -> bool:
    return any(n.startswith("vllm:") for n, _ in snapshot.samples) or any(n.startswith("vllm:") for n in snapshot.info)


def combine(snapshots: Sequence[MetricsSnapshot]) -> MetricsSnapshot:
    """Replicas behind one router as one server: counters summed per series, config labels from the first."""
    samples: dict[tuple[str, Labels], float] = {}
    for snap in snapshots:
        for key, value in snap.samples.items():
            samples[key] = samples.get(key, 0.0) + value
    info = snapshots[0].info if snapshots else {}
    counters = frozenset().union(*(s.counters for s in snapshots))
    created = {k: v for s in snapshots for k, v in s.created.items()}  # any replica's restart shows in its own
    return MetricsSnapshot(
        samples, info, counters, "".join(s.text for s in snapshots), created, max((s.at for s in snapshots), default=0)
    )


def parse(text: str, source: str = "/metrics", at: float = 0.0) -> MetricsSnapshot:
    """`source` names the server in the error a malformed page raises."""
    samples: dict[tuple[str, Labels], float] = {}
    created: dict[tuple[str, Labels], float] = {}
    info: dict[str, dict[str, str]] = {}
    counters: set[str] = set()
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise EndpointError(
            f"{source} is not Prometheus text ({type(exc).__name__}: {str(exc)[:120]})",
            hint="is this URL a vLLM server? its /metrics page should be Prometheus text",
        ) from exc
    for family in families:
        if family.type == "counter":
            counters.add(family.name)
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            if s.name.endswith("_created"):
                created[(s.name.removesuffix("_created"), key[1])] = float(s.value)
                continue
            if family.type == "unknown" and s.name.endswith("_total"):
                counters.add(s.name.removesuffix("_total"))
            if family.type == "histogram" and s.name.endswith("_count"):  # buckets move with it; kept out of scrapes
                counters.add(s.name)
            samples[(s.name.removesuffix("_total"), key[1])] = float(s.value)
            if family.type in ("info", "gauge", "unknown") and s.name.endswith("_info"):
                info[s.name] = dict(s.labels)
    return MetricsSnapshot(samples, info, frozenset(counters), text, created, at)


def from_compact(data: Mapping[str, Any], previous: MetricsSnapshot | None = None) -> MetricsSnapshot:
    """A scrape line back into a snapshot; without `created` it keeps `previous`'s."""

    def keyed(rows: Sequence[Sequence[Any]]) -> dict[tuple[str, Labels], float]:
        return {(str(n), tuple(sorted(dict(ls).items()))): float(v) for n, ls, v in rows}

    return MetricsSnapshot(
        keyed(data.get("samples", [])),
        {},
        frozenset(data.get("counters", [])),
        "",
        keyed(data["created"]) if "created" in data else dict(previous.created if previous else {}),
        float(data.get("at", 0.0)),
    )
