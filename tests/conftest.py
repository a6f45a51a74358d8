"""The real CPU pair (treatment, control, reference), started once for the whole test run and stopped at the end.

Tests that need it are marked `engine`. A server that cannot start fails those tests with its log tail; nothing
here skips.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from servers.launch import Fleet
from servers.profiles import build_specs

from engine_env import BASE_PORT, CACHE, ROOT


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "cpu_fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def cpu_fleet() -> Iterator[Fleet]:
    log_dir = ROOT / "runs" / f"test-servers-{time.strftime('%Y%m%d-%H%M%S')}"
    specs = build_specs("cpu-tiny", ("treatment", "control", "reference"), base_port=BASE_PORT, cache_dir=CACHE)
    with Fleet(specs, log_dir) as fleet:
        fleet.start()
        yield fleet
