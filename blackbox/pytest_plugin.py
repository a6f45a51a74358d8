"""pytest front end: the same engine as the CLI, against live endpoints, one test item per probe.

    pytest --blackbox-treatment URL --blackbox-control URL [--blackbox-reference URL] test_smoke.py
    BLACKBOX_TREATMENT=URL BLACKBOX_CONTROL=URL BLACKBOX_PROBES=multiturn,cold-race pytest test_smoke.py

    def test_no_corruption(blackbox_result):
        blackbox_result.assert_pass()

Each probe named by `--blackbox-probe` (or `BLACKBOX_PROBES`) becomes its own item, `test_no_corruption[multiturn]`,
with its own run folder. A FAIL or UNKNOWN fails the item with the class, the evidence, the run folder and the
replay command; an endpoint or usage ERROR errors it; `--junitxml` carries the same as properties. A missing
endpoint is an error of the test, never a skip: a skipped check reads as a pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from blackbox import probes
from blackbox.cli import execute
from blackbox.config import RunConfig
from blackbox.engine import RunResult
from blackbox.errors import BlackboxError
from blackbox.report import summary
from blackbox.server_info import ServerInfo, server_info, trigger_hint
from blackbox.verdict import Status
from blackbox.workload import Shape

__all__ = ["ENV", "BlackboxOutcome"]

# Option -> environment variable read when the option is not given (CI jobs set these as secrets/variables).
ENV = {
    "treatment": "BLACKBOX_TREATMENT",
    "control": "BLACKBOX_CONTROL",
    "reference": "BLACKBOX_REFERENCE",
    "model": "BLACKBOX_MODEL",
    "conversations": "BLACKBOX_CONVERSATIONS",
    "seed": "BLACKBOX_SEED",
    "out": "BLACKBOX_OUT",
    "probe": "BLACKBOX_PROBES",
    "max_num_batched_tokens": "BLACKBOX_MAX_NUM_BATCHED_TOKENS",
    "detect": "BLACKBOX_DETECT",
    "round": "BLACKBOX_ROUND",
    "max_conversations": "BLACKBOX_MAX_CONVERSATIONS",
    "resumes": "BLACKBOX_RESUMES",
}
_REPLAYS_SHOWN = 3
_N = TypeVar("_N", int, float)
_GRADABLE = ("config.json", "geometry.json", "exchanges.jsonl")  # what `blackbox grade` reads


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("blackbox", "blackbox: prefix-cache x speculative-decoding corruption tester")
    group.addoption("--blackbox-treatment", help="URL of the server under test [BLACKBOX_TREATMENT]")
    group.addoption("--blackbox-control", help="URL of the control, prefix caching off [BLACKBOX_CONTROL]")
    group.addoption("--blackbox-reference", help="URL of the reference, no spec decode [BLACKBOX_REFERENCE]")
    group.addoption("--blackbox-model", help="served model name [BLACKBOX_MODEL]")
    group.addoption("--blackbox-conversations", help="seeded conversations, default 32 [BLACKBOX_CONVERSATIONS]")
    group.addoption("--blackbox-seed", help="default 0 [BLACKBOX_SEED]")
    group.addoption("--blackbox-out", help="parent of the run folders, default runs [BLACKBOX_OUT]")
    group.addoption(
        "--blackbox-probe",
        action="append",
        choices=[*probes.PROBES, probes.ALL],
        help=f"one test item per probe; repeat for several ({probes.all_help()}; default multiturn) "
        "[BLACKBOX_PROBES=a,b]",
    )
    group.addoption(
        "--blackbox-max-num-batched-tokens",
        help="the treatment's step budget, for the cold-race trigger proof [BLACKBOX_MAX_NUM_BATCHED_TOKENS]",
    )
    group.addoption(
        "--blackbox-detect",
        metavar="Q",
        help="the multiturn item sends conversations in rounds until a PASS covers this fraction of decode-region "
        "hits, or a FAIL, or the budget (as `blackbox run --detect`) [BLACKBOX_DETECT]",
    )
    group.addoption("--blackbox-round", help="conversations per round with --blackbox-detect [BLACKBOX_ROUND]")
    group.addoption(
        "--blackbox-max-conversations",
        help="the budget with --blackbox-detect, default 160 [BLACKBOX_MAX_CONVERSATIONS]",
    )
    group.addoption(
        "--blackbox-resumes",
        help="decode-written boundaries each multiturn conversation resumes from, default 1 (as `blackbox run "
        "--resumes`) [BLACKBOX_RESUMES]",
    )


def _setting(config: pytest.Config, name: str) -> Any:
    value = config.getoption(f"--blackbox-{name.replace('_', '-')}")
    return value if value not in (None, []) else os.environ.get(ENV[name]) or None


def _probes(config: pytest.Config) -> list[str]:
    value = _setting(config, "probe")
    names = value if isinstance(value, list) else [p.strip() for p in (value or "multiturn").split(",")]
    try:
        return list(probes.expand(p for p in names if p))
    except BlackboxError as exc:
        raise pytest.UsageError(f"blackbox: {exc} [{ENV['probe']}]") from exc


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "blackbox_probe" in metafunc.fixturenames:
        names = _probes(metafunc.config)
        metafunc.parametrize("blackbox_probe", names, ids=names)


@dataclass(frozen=True)
class BlackboxOutcome:
    result: RunResult
    probe: str = "multiturn"
    servers: Mapping[str, ServerInfo] = field(default_factory=dict)  # role -> its release and cache settings

    @property
    def status(self) -> Status:
        return self.result.verdict.status

    def replays(self) -> list[Path]:
        return sorted((self.result.store_path / "replay").glob("*.sh"))

    def evidence(self) -> list[str]:
        """Each finding that is not a pass, as `check [STATUS Class]: reason`."""
        return [
            f"{f.check} [{f.status.value}{' ' + f.error_class if f.error_class else ''}]: {f.reason}"
            for f in self.result.verdict.findings
            if f.status is not Status.PASS
        ]

    def report(self) -> str:
        """What a CI log needs to act on a non-PASS: class, evidence, run folder, how to replay and re-judge."""
        v, run = self.result.verdict, self.result.store_path
        lines = [f"blackbox {v.status.value}" + (f" ({v.error_class})" if v.error_class else "") + f" [{self.probe}]"]
        lines += ["evidence:", *(f"  {e}" for e in self.evidence() or [v.reason])]
        if v.hint:
            lines.append(f"next: {v.hint}")
        treatment = self.servers.get("treatment")
        hint = trigger_hint(treatment) if treatment is not None else ""
        if v.error_class == "TriggerNotExercised" and hint and treatment is not None:
            # The treatment alone: the control runs without prefix caching on purpose.
            lines.append(f"treatment {treatment.url} (vLLM {treatment.version or 'unknown'}): {hint}")
        lines.append(f"run folder: {run}")
        if (run / "report.html").is_file():
            lines.append(f"report: {run / 'report.html'}")
        replays = self.replays()
        lines += [f"replay: sh {p}" for p in replays[:_REPLAYS_SHOWN]]
        if len(replays) > _REPLAYS_SHOWN:
            lines.append(f"        ... {len(replays) - _REPLAYS_SHOWN} more in {run / 'replay'}")
        if all((run / f).is_file() for f in _GRADABLE):  # a run cut short before geometry cannot be re-judged
            lines.append(f"re-judge: blackbox grade {run}")
        return "\n".join(lines) + "\n\n" + summary(self.result)

    def properties(self) -> list[tuple[str, object]]:
        """For `--junitxml` (<property> elements of the test case)."""
        v = self.result.verdict
        props: list[tuple[str, object]] = [
            ("blackbox_probe", self.probe),
            ("blackbox_status", v.status.value),
            ("blackbox_error_class", v.error_class or ""),
            ("blackbox_exit_code", v.exit_code),
            ("blackbox_reason", v.reason),
            ("blackbox_run_folder", str(self.result.store_path)),
        ]
        if (self.result.store_path / "report.html").is_file():
            props.append(("blackbox_report", str(self.result.store_path / "report.html")))
        props += [("blackbox_evidence", e) for e in self.evidence()]
        props += [("blackbox_replay", f"sh {p}") for p in self.replays()[:_REPLAYS_SHOWN]]
        return props

    def assert_pass(self) -> None:
        if self.status is not Status.PASS:
            pytest.fail(self.report(), pytrace=False)


@pytest.fixture(scope="session")
def blackbox_config(request: pytest.FixtureRequest) -> RunConfig:
    """Every probe named; each item runs the config narrowed to its own probe."""
    cfg = request.config
    treatment, control = _setting(cfg, "treatment"), _setting(cfg, "control")
    if not treatment:
        raise pytest.UsageError(
            f"blackbox needs --blackbox-treatment URL (or {ENV['treatment']}), and --blackbox-control URL unless "
            "the treatment's own no-reuse answers are the control (a staging smoke test); a missing endpoint is an "
            "error, not a skip"
        )
    conversations, seed = _int(cfg, "conversations"), _int(cfg, "seed")
    round_conversations, budget = _int(cfg, "round"), _int(cfg, "max_conversations")
    resumes = _int(cfg, "resumes")
    try:
        return RunConfig(
            treatment=treatment,
            control=control,
            reference=_setting(cfg, "reference"),
            model=_setting(cfg, "model"),
            conversations=32 if conversations is None else conversations,
            seed=0 if seed is None else seed,
            probes=tuple(_probes(cfg)),
            max_num_batched_tokens=_int(cfg, "max_num_batched_tokens"),
            detect=_number(cfg, "detect", float, "a number"),
            round_conversations=RunConfig.round_conversations if round_conversations is None else round_conversations,
            max_conversations=RunConfig.max_conversations if budget is None else budget,
            shape=Shape(resumes=Shape.resumes if resumes is None else resumes),
        )
    except BlackboxError as exc:
        raise pytest.UsageError(f"blackbox: {exc}") from exc


def _number(config: pytest.Config, name: str, parse: Callable[[str], _N], what: str) -> _N | None:
    value = _setting(config, name)
    if value is None:
        return None
    try:
        return parse(value)
    except ValueError:
        raise pytest.UsageError(f"blackbox: {name} must be {what}, got {value!r}") from None


def _int(config: pytest.Config, name: str) -> int | None:
    return _number(config, name, int, "an integer")


@pytest.fixture(scope="session")
def blackbox_servers(blackbox_config: RunConfig) -> dict[str, ServerInfo]:
    """Each role's vLLM release and cache settings, read once (recorded, and used in the failure hint)."""
    c = blackbox_config
    urls = {
        role: url
        for role, url in (("treatment", c.treatment), ("control", c.control), ("reference", c.reference))
        if url
    }
    return asyncio.run(_read_servers(urls, c.api_key))


async def _read_servers(urls: Mapping[str, str], api_key: str | None) -> dict[str, ServerInfo]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(url: str) -> ServerInfo:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
            return await server_info(http)

    infos = await asyncio.gather(*(one(u) for u in urls.values()))
    return dict(zip(urls, infos, strict=True))


@pytest.fixture(scope="session")
def _blackbox_runs(request: pytest.FixtureRequest, blackbox_config: RunConfig) -> Iterator[Callable[[str], RunResult]]:
    out = Path(_setting(request.config, "out") or "runs")
    command = ["pytest", *request.config.invocation_params.args]
    done: dict[str, RunResult] = {}

    def run(probe: str) -> RunResult:
        if probe not in done:
            # Rounds are multiturn conversations: the other probes' items run once, at their fixed length.
            detect = blackbox_config.detect if probe == probes.MULTITURN.name else None
            config = dataclasses.replace(blackbox_config, probes=(probe,), detect=detect)
            try:
                done[probe] = execute(config, out, command)
            except FileExistsError:  # run ids have one-second resolution: a run that ended at once collides
                time.sleep(1.0)
                done[probe] = execute(config, out, command)
        return done[probe]

    yield run


@pytest.fixture
def blackbox_probe(request: pytest.FixtureRequest) -> str:
    """Parametrized by `pytest_generate_tests` with the probes asked for."""
    return str(getattr(request, "param", "multiturn"))


@pytest.fixture
def blackbox_result(
    request: pytest.FixtureRequest,
    blackbox_probe: str,
    blackbox_servers: dict[str, ServerInfo],
    _blackbox_runs: Callable[[str], RunResult],
) -> BlackboxOutcome:
    """This item's probe run against the live servers. An ERROR verdict (endpoint, usage) errors the item here;
    FAIL and UNKNOWN reach the test, whose `assert_pass` fails it."""
    for role, info in blackbox_servers.items():
        request.node.user_properties.append((f"blackbox_{role}_vllm_version", info.version or "unknown"))
    outcome = BlackboxOutcome(_blackbox_runs(blackbox_probe), blackbox_probe, blackbox_servers)
    request.node.user_properties.extend(outcome.properties())
    if outcome.status is Status.ERROR:
        pytest.fail(outcome.report(), pytrace=False)
    return outcome
