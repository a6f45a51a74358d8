"""Before the workload: are the arms what their roles say, and do they serve one model?

Treatment, control and reference are compared with each other; a control serving another model, a treatment
URL passed twice, or a control without the treatment's speculative decoding makes every later comparison
meaningless, so these are checked in seconds, before any conversation, and a failure is a `UsageError` (exit 3):

- every URL distinct (after normalising the host: localhost and 127.0.0.1 are one server);
- one served model name and one `max_model_len`;
- one tokenizer: `/tokenize` on a fixed text gives the same token ids everywhere;
- the same greedy answer to a short fixed prompt computed cold (fresh `cache_salt`): identical up to near-ties,
  no token where the two part while one of them was sure (top-1 margin >= `hard_margin`), no deviation of
  `hard_margin` or more (a different model or compile mode parts on its first few tokens);
- roles: the treatment caches, the control does not and runs speculative decoding, the reference caches, reports
  `cached_tokens` and runs no speculative decoding;
- the reference keeps the treatment's cache settings where both publish them (`vllm:cache_config_info`): its hits
  are the yardstick for the treatment's, so a reference that stores the recurrent state in another dtype (or
  caches in another mode) deviates from recomputation by another amount, and a correct treatment would read as
  corrupt against it;
- the reference computes like the treatment in every setting that changes a correct engine's numerics (step
  budget, batch size, backends, dtypes, parallelism, release: `yardstick`), a `ConfigMismatch` otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from blackbox import errors, geometry, metrics, yardstick
from blackbox.client import Endpoint
from blackbox.compare import deviation
from blackbox.history import Arm, Exchange
from blackbox.metrics import MetricsSnapshot
from blackbox.server_info import ServerInfo
from blackbox.verdict import Finding

__all__ = ["ArmFacts", "check", "gather"]

_TEXT = "the code of amber is alpha bravo two . read the record and remember every code ."
_PROMPT = ({"role": "user", "content": "write a long story about the record of amber and birch ."},)
_ANSWER_TOKENS = 16


@dataclass(frozen=True)
class ArmFacts:
    arm: str
    url: str
    model: str | None
    max_model_len: int | None
    token_ids: tuple[int, ...]
    answer: Exchange
    snapshot: MetricsSnapshot


async def gather(
    endpoint: Endpoint, snapshot: MetricsSnapshot, salt: str, record: Callable[[Exchange], object]
) -> ArmFacts:
    body = {
        "messages": list(_PROMPT),
        "temperature": 0.0,
        "max_tokens": _ANSWER_TOKENS,
        "logprobs": True,
        "top_logprobs": 5,
        "seed": 0,
        "cache_salt": f"{salt}-comparability-{endpoint.arm}",
    }
    answer = await endpoint.chat(body, conversation=-1, kind="comparability")
    record(answer)
    # A server that fails or drops logprobs is broken, not of another model: an endpoint error, not a usage one.
    if not answer.ok:
        raise errors.EndpointError(
            f"{endpoint.arm}: a short greedy request failed: {answer.error}",
            hint="see exchanges.jsonl in the run folder and the server log",
        )
    if not answer.tokens or any(not math.isfinite(t.logprob) for t in answer.tokens):
        raise errors.EndpointError(
            f"{endpoint.arm} at {endpoint.base_url} answered without finite logprobs",
            hint="the server must honour `logprobs` and `top_logprobs` (check --max-logprobs and any proxy)",
        )
    return ArmFacts(
        endpoint.arm,
        endpoint.base_url,
        endpoint.model,
        await endpoint.max_model_len(),
        tuple(await endpoint.tokenize(_TEXT)),
        answer,
        snapshot,
    )


def check(
    facts: Mapping[str, ArmFacts],
    hard_margin: float,
    infos: Mapping[str, ServerInfo] | None = None,
    probes: Sequence[str] = ("multiturn",),
) -> list[Finding]:
    """One finding per concern: `comparability` (one model everywhere), `roles` (each server as its role) and,
    given what the servers say of themselves, `yardstick` (the reference computes like the treatment)."""
    found = [_comparable(facts, hard_margin), _roles(facts)]
    if infos is not None:
        found.append(yardstick.check(infos, probes))
    return found


def _comparable(facts: Mapping[str, ArmFacts], hard_margin: float) -> Finding:
    problems: list[str] = []
    by_url: dict[str, list[str]] = {}
    for f in facts.values():
        by_url.setdefault(_normal(f.url), []).append(f.arm)
    problems += [f"{' and '.join(arms)} are one server ({url})" for url, arms in by_url.items() if len(arms) > 1]
    treatment = facts[Arm.TREATMENT]
    figures: dict[str, object] = {"answers": {}}
    for other in (f for f in facts.values() if f.arm != Arm.TREATMENT):
        if other.model != treatment.model:
            problems.append(f"the {other.arm} serves {other.model!r}, the treatment {treatment.model!r}")
        if other.max_model_len != treatment.max_model_len:
            problems.append(
                f"the {other.arm} has max_model_len {other.max_model_len}, the treatment {treatment.max_model_len}"
            )
        if other.token_ids != treatment.token_ids:
            problems.append(f"the {other.arm} tokenizes a fixed text differently from the treatment")
        problem, dev = _same_answer(treatment.answer, other.answer, hard_margin)
        figures["answers"] = {**figures["answers"], other.arm: dev}  # type: ignore[dict-item]
        if problem:
            problems.append(f"the {other.arm}: {problem}")
    if problems:
        return Finding.from_error(
            "comparability",
            errors.UsageError(
                "the servers are not one model: " + "; ".join(problems),
                hint="point --treatment, --control and --reference at servers of the same model, weights, tokenizer "
                "and compile mode (e.g. all eager or none), differing only in the flags of their roles",
            ),
            **figures,
        )
    return Finding.passed(
        "comparability",
        f"{len(facts)} distinct servers of {treatment.model!r}: same tokenizer, max_model_len and greedy answer",
        **figures,
    )


def _same_answer(mine: Exchange, theirs: Exchange, hard_margin: float) -> tuple[str | None, float | None]:
    dev = deviation(theirs.tokens, mine.tokens, hard_margin)
    if dev >= hard_margin:
        text = "a token where the treatment was sure" if dev == math.inf else f"a deviation of {dev:.3g} nat"
        return f"its greedy answer to a fixed prompt parts from the treatment's at {text}", dev
    return None, dev


def _roles(facts: Mapping[str, ArmFacts]) -> Finding:
    problems = []
    treatment = facts[Arm.TREATMENT].snapshot
    if Arm.CONTROL in facts:
        control = facts[Arm.CONTROL].snapshot
        if geometry.prefix_caching(control) is True:
            problems.append("the control has prefix caching on: start it with --no-enable-prefix-caching")
        if control.value(metrics.DRAFTS) is None:
            problems.append(
                "the control runs no speculative decoding: start it with the treatment's --speculative-config"
            )
    if geometry.prefix_caching(treatment) is False:
        problems.append("the treatment has prefix caching off: start it with --enable-prefix-caching")
    if Arm.REFERENCE in facts:
        reference = facts[Arm.REFERENCE]
        if reference.snapshot.value(metrics.DRAFTS) is not None:
            problems.append("the reference runs speculative decoding: start it without --speculative-config")
        if geometry.prefix_caching(reference.snapshot) is False:
            problems.append("the reference has prefix caching off: start it with the treatment's cache flags")
        if reference.answer.ok and reference.answer.cached_tokens is None:
            problems.append("the reference reports no cached_tokens: start it with --enable-prompt-tokens-details")
        problems += _cache_differences(facts[Arm.TREATMENT].snapshot, reference.snapshot)
    if problems:
        return Finding.from_error(
            "roles", errors.UsageError("; ".join(problems), hint="fix the server flags and re-run")
        )
    return Finding.passed("roles", "servers match their roles")


# Settings that change how far a correct hit deviates from recomputation (dtypes of what is cached, which states are
# checkpointed). Capacity figures (blocks, memory) legitimately differ: the drafter takes memory.
_YARDSTICK_SETTINGS = (
    "cache_dtype",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
    "mamba_cache_mode",
    "prefix_cache_retention_interval",
)


def _cache_differences(treatment: MetricsSnapshot, reference: MetricsSnapshot) -> list[str]:
    mine = treatment.info.get(metrics.CACHE_CONFIG_INFO, {})
    theirs = reference.info.get(metrics.CACHE_CONFIG_INFO, {})
    return [
        f"the reference has {name}={theirs[name]}, the treatment {mine[name]}: start it with the treatment's cache "
        "flags (its hits are the yardstick for the treatment's)"
        for name in _YARDSTICK_SETTINGS
        if name in mine and name in theirs and mine[name] != theirs[name]
    ]


def _normal(url: str) -> str:
    parts = urlsplit(url.rstrip("/"))
    host = (parts.hostname or "").lower()
    host = "127.0.0.1" if host == "localhost" else host
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}{parts.path}"
