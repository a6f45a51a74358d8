"""A run is data: one frozen `RunConfig`, validated here and nowhere else."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from blackbox import inputs, secrets
from blackbox.errors import UsageError
from blackbox.sequential import PLAN_SHARE, Schedule, planned_look
from blackbox.workload import MAX_RESUMES, Shape

__all__ = ["GRADERS", "PROBES", "Grading", "RaceSettings", "RunConfig"]

GRADERS = ("exactness", "recall", "logprob")
# The names of the probes in `blackbox.probes.PROBES`, in the order they run (a test checks the two agree; the
# registry imports this module, so this one cannot import it).
PROBES = ("multiturn", "cold-race", "held-prefix", "short-follow-up", "load", "preemption", "hit-geometry")


@dataclass(frozen=True)
class RaceSettings:
    """The cold-race probe's rounds (blackbox.probes.cold_race)."""

    racers: int = 8
    rounds_per_size: int = 3
    sizes: tuple[float, ...] = (1.5, 2.5)  # prompt length in blocks
    followups: int = 4
    max_tokens: int = 32  # of each follow-up; racers decode past the block their prompt ends in
    top_logprobs: int = 5


@dataclass(frozen=True)
class Grading:
    """Gate and grader settings. Defaults are the ones bench/results/ was measured with."""

    alpha: float = 0.01
    min_trigger_fraction: float = 0.5  # of conversations whose turn-2 hit must reach decode-written blocks
    min_control_recall: float = 0.5
    hard_margin: float = 1.0  # nats: a divergence where the no-reuse arm was this sure is not a near-tie
    # Answer positions compared, hit against its no-reuse twin: the first token (the prefill that resumes from the
    # hit) and the first verification step, 1 + k tokens for k speculative tokens. Later positions were verified
    # in draft splits that differ between the two (acceptance depends on the numerics), so on GPUs they drift
    # apart on a correct engine, more under speculative decoding than without: the reference would not be a fair
    # yardstick. None: 2 + k, k read from the treatment's /metrics (graders.compared_positions).
    compare_tokens: int | None = None
    graders: tuple[str, ...] = ()  # empty: auto
    # Settings the yardstick gate could not check on the reference (a server without /server_info): set by
    # `engine.judge` from the preflight, so a grader whose yardstick is bit-exact does not demand exactness of a
    # treatment that may be scheduled otherwise (docs/comparability.md).
    yardstick_assumed: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunConfig:
    treatment: str
    control: str | None = None  # None: single-endpoint mode, the treatment's own no-reuse answers are the control
    reference: str | None = None
    model: str | None = None
    conversations: int = 32
    # The reference runs this many times the treatment's conversations (the extra ones on the reference alone).
    # A sporadic fault shows as a few treatment hits beyond every reference deviation, and the exceedance test's
    # smallest significant count falls with the yardstick's size: at 32 conversations and the default alpha it
    # needs 10 such hits against 1x, 7 against 2x, 5 against 3x (stats.exceedance_critical). Extra reference
    # conversations are independent draws of the same seeded workload, so they stay exchangeable with the
    # treatment's under a correct engine.
    reference_ratio: int = 2
    seed: int = 0
    concurrency: int = 8
    block_size: int | None = None
    api_key_env: str = "BLACKBOX_API_KEY"
    timeout_s: float = 300.0
    settle_s: float = 30.0
    shape: Shape = field(default_factory=Shape)
    grading: Grading = field(default_factory=Grading)
    probes: tuple[str, ...] = ("multiturn",)
    race: RaceSettings = field(default_factory=RaceSettings)
    max_num_batched_tokens: int | None = None  # the treatment's step budget, if /server_info is not offered
    treatment_metrics: tuple[str, ...] = ()  # the /metrics URLs of replicas behind the treatment's router
    # Reliability (issue 9): the key's file, the whole-run deadline, the heartbeat and mid-run /metrics scrapes.
    api_key_file: str | None = None  # read instead of the variable; the path is stored, never the key
    deadline_s: float | None = None  # the whole run, set-up to verdict; None: no limit
    heartbeat_s: float = 15.0  # a line on stderr while a request has waited this long
    scrape_s: float = 5.0  # /metrics of every server this often during the run, so a restart is caught
    # A run that stops when the answer is known (blackbox.sequential): None is the fixed-length run of
    # `conversations`; else the fraction of decode-region hits a PASS must be able to see corrupted, with rounds
    # of `round_conversations` up to `max_conversations`.
    detect: float | None = None
    round_conversations: int = 8
    max_conversations: int = 160
    # The share of alpha spent by the look where a PASS is planned (blackbox.sequential); 0 spends it linearly,
    # as runs stored before the plan did, so `blackbox grade` judges them at the levels they ran at.
    plan_share: float = PLAN_SHARE

    def __post_init__(self) -> None:
        _require(self.conversations >= 1, "--conversations must be at least 1")
        _require(self.concurrency >= 1, "--concurrency must be at least 1")
        _require(self.reference_ratio >= 1, "--reference-ratio must be at least 1")
        _require(self.block_size is None or self.block_size > 0, "--block-size must be positive")
        _require(0 < self.grading.alpha < 1, "--alpha must be between 0 and 1")
        _require(
            self.grading.compare_tokens is None or self.grading.compare_tokens >= 1,
            "--compare-tokens must be at least 1",
        )
        _require(0 < self.grading.min_trigger_fraction <= 1, "--min-trigger-fraction must be in (0, 1]")
        _require(bool(self.probes), "name at least one --probe")
        for p in self.probes:
            _require(p in PROBES, f"unknown probe {p!r}; choose from {', '.join(PROBES)}")
        _require(self.race.racers >= 2, "--racers must be at least 2")
        for g in self.grading.graders:
            _require(g in GRADERS, f"unknown grader {g!r}; choose from {', '.join(GRADERS)} or auto")
        for name in ("treatment", "control", "reference"):
            url = getattr(self, name)
            _require(
                url is None or url.startswith(("http://", "https://")),
                f"--{name} must be an http(s) URL, got {url!r}",
            )
        _require(
            self.shape.prompt_blocks >= 2,
            "--prompt-blocks must be at least 2 (the probe needs a cached block)",
        )
        _require(self.shape.answer_blocks >= 1, "--answer-blocks must be at least 1")
        _require(
            1 <= self.shape.resumes <= MAX_RESUMES,
            f"--resumes must be between 1 and {MAX_RESUMES} (decode-written boundaries a conversation resumes from)",
        )
        _check_reliability(self)
        if self.detect is not None:
            _require(0 < self.detect < 1, "--detect must be a fraction of hits between 0 and 1, e.g. 0.2")
            _require(self.round_conversations >= 1, "--round must be at least 1")
            _require(
                self.max_conversations >= self.round_conversations,
                "--max-conversations must be at least --round",
            )
            _require("multiturn" in self.probes, "--detect needs the multiturn probe: its conversations are the rounds")
            _require(0 <= self.plan_share < 1, "plan_share must be in [0, 1)")

    @property
    def schedule(self) -> Schedule | None:
        """The planned looks of a run with --detect; None for a fixed-length run."""
        if self.detect is None:
            return None
        base = Schedule(self.round_conversations, self.max_conversations, self.grading.alpha, self.reference_ratio)
        if not self.plan_share:
            return base
        graders = len(self.grading.graders) or None  # None: the graders a run picks itself
        planned = planned_look(self.detect, self.shape.resumes, base, graders, share=self.plan_share)
        return replace(base, planned=planned, share=self.plan_share)

    @property
    def yardstick_base(self) -> int:
        """The index the reference's extra conversations are numbered from (past every treatment conversation)."""
        return self.conversations if self.detect is None else self.max_conversations

    @property
    def api_key(self) -> str | None:
        return secrets.read_key(self.api_key_env, self.api_key_file)

    def to_json(self) -> dict[str, Any]:
        """Everything needed to replay the run; the API key is named by its variable, never stored."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunConfig:
        race = {**data.get("race", {})}
        race["sizes"] = tuple(race.get("sizes", RaceSettings.sizes))
        grading = {**data.get("grading", {})}
        grading["graders"] = tuple(grading.get("graders", ()))
        return cls(
            **{
                **data,
                "shape": Shape(**data.get("shape", {})),
                "grading": Grading(**grading),
                "race": RaceSettings(**race),
                "probes": tuple(data.get("probes", ("multiturn",))),
                "treatment_metrics": tuple(data.get("treatment_metrics", ())),
                "reference_ratio": data.get("reference_ratio", 1),  # folders from before the option: 1x
                "plan_share": data.get("plan_share", 0.0),  # folders from before the plan: linear spending
            }
        )


def _check_reliability(config: RunConfig) -> None:
    secrets.check_env_name(config.api_key_env)
    for name in ("treatment", "control", "reference"):
        url = getattr(config, name)
        if url is not None:
            inputs.check_url(f"--{name}", url)
    for url in config.treatment_metrics:
        inputs.check_url("--treatment-metrics", url, root=False)
    inputs.positive("--request-timeout", config.timeout_s, minimum=0.1)
    inputs.positive("--deadline", config.deadline_s, minimum=1)
    inputs.positive("--heartbeat", config.heartbeat_s, minimum=0.1)
    _require(config.scrape_s >= 0, "--scrape-interval must be 0 (off) or positive")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message, hint="see `blackbox run --help`")
