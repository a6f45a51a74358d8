"""Block size from the server's own labels, and the failures that stop a run before it starts."""

from __future__ import annotations

import pytest

from blackbox import errors, geometry, metrics

import histories as h


def test_block_size_comes_from_cache_config_info_not_the_stale_mamba_label() -> None:
    snap = metrics.parse(h.prom({}, block_size=128))  # mamba_block_size="16" beside it
    geo = geometry.discover(snap, 4096, None)
    assert (geo.block_size, geo.max_model_len) == (128, 4096)
    assert geo.block_size_source == metrics.CACHE_CONFIG_INFO


def test_an_override_wins() -> None:
    geo = geometry.discover(metrics.parse(h.prom({}, block_size=128)), 4096, 528)
    assert (geo.block_size, geo.block_size_source) == (528, "--block-size")


def test_no_block_size_label_is_geometry_unsupported() -> None:
    with pytest.raises(errors.GeometryUnsupported) as info:
        geometry.discover(metrics.parse(""), 4096, None)
    assert "--block-size" in info.value.hint


def test_no_max_model_len_is_geometry_unsupported() -> None:
    with pytest.raises(errors.GeometryUnsupported):
        geometry.discover(metrics.parse(h.prom({})), None, 128)


def test_prefix_caching_flag() -> None:
    on = metrics.parse(h.prom({}))
    off = metrics.parse(h.prom({}).replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"'))
    assert geometry.prefix_caching(on) is True
    assert geometry.prefix_caching(off) is False
    assert geometry.prefix_caching(metrics.parse("")) is None
