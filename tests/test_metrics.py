"""Parsing vLLM's /metrics text, deltas between two reads, and the restart that makes a delta meaningless."""

from __future__ import annotations

import dataclasses
import json

import pytest

from blackbox import errors, metrics

import histories as h

# What a vLLM 0.32 CPU server exposes, trimmed: counters come as `_total` with a `_created` gauge beside them,
# every series carries engine/model_name labels, and the cache config is a gauge whose labels are the config.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 4096.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7543e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1280.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7543e+09
# HELP vllm:prompt_tokens_cached_by_source_total Cached prompt tokens by source.
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tiny",source="local_compute"} 1024.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"} 256.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 300.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 230.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 190.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="tiny",position="0"} 1.7543e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="tiny",position="1"} 1.7543e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",mamba_block_size="16",\
num_gpu_blocks="2340",prefix_cache_retention_interval="None"} 1.0
"""


def _bump(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


@pytest.fixture
def snap() -> metrics.MetricsSnapshot:
    return metrics.parse(VLLM_TEXT)


def test_counters_are_read_without_total_and_created_is_dropped(snap: metrics.MetricsSnapshot) -> None:
    assert snap.value(metrics.CACHE_QUERIES) == 4096
    assert snap.value(metrics.CACHE_HITS) == 1280
    assert snap.value(metrics.DRAFTS) == 300
    assert snap.value(metrics.CACHE_HITS + "_created") is None
    assert snap.value(metrics.CACHE_HITS + "_total") is None
    assert {metrics.CACHE_HITS, metrics.CACHE_QUERIES, metrics.DRAFTS} <= snap.counters
    assert "vllm:num_requests_running" not in snap.counters
    assert snap.text == VLLM_TEXT


def test_value_sums_every_label_set_and_filters_by_label(snap: metrics.MetricsSnapshot) -> None:
    by_source = "vllm:prompt_tokens_cached_by_source"
    assert snap.value(by_source) == 1280
    assert snap.value(by_source, source="local_cache_hit") == 256
    assert snap.value(by_source, source="remote") is None
    assert snap.value(metrics.ACCEPTED_PER_POS) == 420
    assert snap.value(metrics.ACCEPTED_PER_POS, position="1", engine="0") == 190


def test_absent_metric_is_none_not_zero(snap: metrics.MetricsSnapshot) -> None:
    assert snap.value(metrics.DRAFT_TOKENS) is None
    assert snap.value(metrics.ACCEPTED) is None


def test_per_position_labels(snap: metrics.MetricsSnapshot) -> None:
    assert snap.per_label(metrics.ACCEPTED_PER_POS, "position") == {"0": 230, "1": 190}
    assert snap.per_label(metrics.CACHE_HITS, "position") == {}


def test_cache_config_info_labels(snap: metrics.MetricsSnapshot) -> None:
    info = snap.info[metrics.CACHE_CONFIG_INFO]
    assert info["block_size"] == "128"
    assert info["mamba_block_size"] == "16"
    assert info["prefix_cache_retention_interval"] == "None"
    assert info["enable_prefix_caching"] == "True"


def test_delta_subtracts_per_series(snap: metrics.MetricsSnapshot) -> None:
    text = _bump(VLLM_TEXT, 'model_name="tiny"} 1280.0', 'model_name="tiny"} 2048.0')
    text = _bump(text, 'position="1"} 190.0', 'position="1"} 250.0')
    delta = metrics.MetricsDelta(snap, metrics.parse(text))
    assert delta.value(metrics.CACHE_HITS) == 768
    assert delta.value(metrics.CACHE_QUERIES) == 0  # present and unmoved: zero, not None
    assert delta.per_label(metrics.ACCEPTED_PER_POS, "position") == {"0": 0, "1": 60}
    assert delta.value(metrics.ACCEPTED) is None


def test_delta_of_a_series_that_appears_counts_from_zero(snap: metrics.MetricsSnapshot) -> None:
    extra = (
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n"
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 42.0\n'
    )
    delta = metrics.MetricsDelta(snap, metrics.parse(VLLM_TEXT + extra))
    assert delta.value(metrics.ACCEPTED) == 42


def test_growing_counters_are_monotonic(snap: metrics.MetricsSnapshot) -> None:
    later = metrics.parse(_bump(VLLM_TEXT, "} 300.0", "} 900.0"))
    metrics.MetricsDelta(snap, later).check_monotonic("treatment")


def test_a_gauge_going_down_is_not_a_reset(snap: metrics.MetricsSnapshot) -> None:
    later = metrics.parse(_bump(VLLM_TEXT, 'model_name="tiny"} 2.0', 'model_name="tiny"} 0.0'))
    metrics.MetricsDelta(snap, later).check_monotonic("treatment")


def test_a_counter_that_went_backwards_is_a_counter_reset(snap: metrics.MetricsSnapshot) -> None:
    restarted = metrics.parse(_bump(VLLM_TEXT, 'model_name="tiny"} 1280.0', 'model_name="tiny"} 64.0'))
    with pytest.raises(errors.CounterReset) as info:
        metrics.MetricsDelta(snap, restarted).check_monotonic("treatment")
    assert "treatment" in str(info.value)
    assert metrics.CACHE_HITS in str(info.value)
    assert "1280 -> 64" in str(info.value)


def test_a_labelled_counter_that_went_backwards_is_a_counter_reset(snap: metrics.MetricsSnapshot) -> None:
    restarted = metrics.parse(_bump(VLLM_TEXT, 'position="0"} 230.0', 'position="0"} 3.0'))
    with pytest.raises(errors.CounterReset):
        metrics.MetricsDelta(snap, restarted).check_monotonic("control")


@pytest.mark.parametrize(
    "text",
    [
        "<html><body><h1>404 Not Found</h1></body></html>",
        "garbage",
        'vllm:prefix_cache_hits_total{engine="0" 12.0',
    ],
)
def test_malformed_text_is_an_endpoint_error(text: str) -> None:
    with pytest.raises(errors.EndpointError, match="not Prometheus text"):
        metrics.parse(text)


def test_empty_text_has_no_counters() -> None:
    empty = metrics.parse("")
    assert empty.value(metrics.CACHE_HITS) is None
    assert metrics.MetricsDelta(empty, empty).value(metrics.CACHE_HITS) is None


# --- restarts: at any scrape, by _created, by process start time, untyped counters --------------------------


def test_a_dip_seen_only_mid_run_is_a_reset(snap: metrics.MetricsSnapshot) -> None:
    restarted = metrics.parse(_bump(VLLM_TEXT, "} 1280.0", "} 3.0"))
    grown = metrics.parse(_bump(VLLM_TEXT, "} 1280.0", "} 9999.0"))
    metrics.MetricsDelta(snap, grown).check_monotonic("treatment")  # before/after alone: looks fine
    with pytest.raises(errors.CounterReset, match=r"vllm:prefix_cache_hits went backwards \(1280 -> 3\)"):
        metrics.MetricsDelta(snap, grown, (snap, restarted, grown)).check_monotonic("treatment")


def test_a_changed_created_timestamp_is_a_reset_even_when_counters_grew(snap: metrics.MetricsSnapshot) -> None:
    later = metrics.parse(
        _bump(
            VLLM_TEXT,
            'vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7543e+09',
            'vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7544e+09',
        )
    )
    assert snap.created[("vllm:prefix_cache_hits", (("engine", "0"), ("model_name", "tiny")))] == 1.7543e9
    with pytest.raises(errors.CounterReset, match=r"vllm:prefix_cache_hits_created changed"):
        metrics.MetricsDelta(snap, later).check_monotonic("treatment")


def test_a_changed_process_start_time_is_a_reset() -> None:
    before = metrics.parse(VLLM_TEXT + "process_start_time_seconds 1000.0\n")
    after = metrics.parse(VLLM_TEXT + "process_start_time_seconds 2000.0\n")
    with pytest.raises(errors.CounterReset, match=r"process_start_time_seconds changed \(1000 -> 2000\)"):
        metrics.MetricsDelta(before, after).check_monotonic("control")


def test_counters_without_type_lines_are_checked_too() -> None:
    untyped = 'vllm:prefix_cache_hits_total{engine="0"} 50.0\nvllm:cache_config_info{block_size="16"} 1.0\n'
    before = metrics.parse(untyped)
    assert "vllm:prefix_cache_hits" in before.counters
    assert before.info[metrics.CACHE_CONFIG_INFO]["block_size"] == "16"  # info without a TYPE line is still read
    after = metrics.parse(untyped.replace("50.0", "7.0"))
    with pytest.raises(errors.CounterReset):
        metrics.MetricsDelta(before, after).check_monotonic("treatment")


def test_histogram_counts_are_counters() -> None:
    text = '# TYPE h histogram\nh_bucket{le="+Inf"} 5\nh_count 5\nh_sum 2.5\n'
    before, after = metrics.parse(text), metrics.parse(text.replace(" 5\n", " 1\n"))
    assert metrics.restarts([before, after])


def test_compact_round_trip_keeps_what_restart_detection_reads(snap: metrics.MetricsSnapshot) -> None:
    back = metrics.from_compact(json.loads(json.dumps(snap.compact())))
    assert back.counters == snap.counters and back.created == snap.created
    assert back.value(metrics.CACHE_HITS) == snap.value(metrics.CACHE_HITS)
    assert metrics.restarts([snap, back]) == []


def test_a_parse_error_names_the_server() -> None:
    with pytest.raises(errors.EndpointError, match=r"control at http://c:1/metrics is not Prometheus text"):
        metrics.parse("<html>{{{ 1", source="control at http://c:1/metrics")


def test_is_vllm() -> None:
    assert metrics.is_vllm(metrics.parse(VLLM_TEXT))
    assert not metrics.is_vllm(metrics.parse("http_requests_total 3\n"))


def test_scrapes_are_judged_in_time_order_not_list_order() -> None:
    # Periodic scrapes go on while the settled `after` snapshot is read, so one taken later can precede it in the
    # list; a counter that only grew must not read as a restart (seen on the CPU pair with process_cpu_seconds).
    early = dataclasses.replace(h.snapshot({metrics.CACHE_HITS: 10}), at=66.0)
    late = dataclasses.replace(h.snapshot({metrics.CACHE_HITS: 12}), at=68.0)
    start = dataclasses.replace(h.snapshot({metrics.CACHE_HITS: 0}), at=1.0)
    metrics.MetricsDelta(start, early, (start, late, early)).check_monotonic("treatment")
    with pytest.raises(errors.CounterReset):
        after = dataclasses.replace(early, at=70.0)  # the same numbers, read after `late`: a restart
        metrics.MetricsDelta(start, after, (start, after, late)).check_monotonic("treatment")


def test_before_and_after_read_back_from_files_stay_first_and_last() -> None:
    # `blackbox grade` parses metrics/<arm>-{before,after}.prom, which carry no time (at = 0); the stored scrapes
    # carry theirs. A clean run must re-grade clean.
    before, after = h.snapshot({metrics.CACHE_HITS: 0}), h.snapshot({metrics.CACHE_HITS: 12})
    during = [
        dataclasses.replace(h.snapshot({metrics.CACHE_HITS: n}), at=t) for n, t in ((0, 0.5), (5, 3.0), (12, 6.0))
    ]
    metrics.MetricsDelta(before, after, during).check_monotonic("treatment")
