"""pytest front end: the same engine as the CLI, against live endpoints named on the command line.

    pytest --blackbox-treatment URL --blackbox-control URL [--blackbox-reference URL] tests/test_smoke.py

    def test_no_corruption(blackbox_result):
        blackbox_result.assert_pass()

A missing endpoint is an error of the test, never a skip: a skipped check reads as a pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from blackbox.cli import execute
from blackbox.config import RunConfig
from blackbox.engine import RunResult
from blackbox.report import summary
from blackbox.verdict import Status

__all__ = ["BlackboxOutcome"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("blackbox", "blackbox: prefix-cache x speculative-decoding corruption tester")
    group.addoption("--blackbox-treatment", help="URL of the server under test")
    group.addoption("--blackbox-control", help="URL of the control (prefix caching off)")
    group.addoption("--blackbox-reference", help="URL of the reference (speculative decoding off)")
    group.addoption("--blackbox-model", help="served model name")
    group.addoption("--blackbox-conversations", type=int, default=32)
    group.addoption("--blackbox-seed", type=int, default=0)
    group.addoption("--blackbox-out", type=Path, default=Path("runs"))


@dataclass(frozen=True)
class BlackboxOutcome:
    result: RunResult

    def assert_pass(self) -> None:
        if self.result.verdict.status is not Status.PASS:
            pytest.fail(summary(self.result), pytrace=False)


@pytest.fixture(scope="session")
def blackbox_config(request: pytest.FixtureRequest) -> RunConfig:
    opt = request.config.getoption
    treatment, control = opt("--blackbox-treatment"), opt("--blackbox-control")
    if not treatment or not control:
        raise pytest.UsageError("blackbox needs --blackbox-treatment URL and --blackbox-control URL")
    return RunConfig(
        treatment=treatment,
        control=control,
        reference=opt("--blackbox-reference"),
        model=opt("--blackbox-model"),
        conversations=opt("--blackbox-conversations"),
        seed=opt("--blackbox-seed"),
    )


@pytest.fixture(scope="session")
def blackbox_result(request: pytest.FixtureRequest, blackbox_config: RunConfig) -> BlackboxOutcome:
    out = request.config.getoption("--blackbox-out")
    return BlackboxOutcome(execute(blackbox_config, out, ["pytest", *request.config.invocation_params.args]))
