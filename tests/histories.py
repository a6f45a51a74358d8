"""Hand-built histories for checker tests: a few numbers in, the records gates and graders read out.

The geometry is tiny so the numbers stay readable: blocks of 16 tokens, turn 1's prompt 44 tokens (4 below the
third block boundary), a prompt-region hit of 32 tokens and a decode-region hit of 64 (>= 44 + 16).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from blackbox import metrics
from blackbox.history import Arm, Exchange, History, Kind, Plan, TokenLogprob
from blackbox.metrics import MetricsDelta, MetricsSnapshot

BLOCK = 16
PROMPT = 3 * BLOCK - 4
PROMPT_HIT = 2 * BLOCK
DECODE_HIT = 4 * BLOCK
ANSWER = "alpha bravo two"

Counters = Mapping[str, float | Mapping[str, float]]

# A treatment whose cache hit and whose drafter proposed and accepted.
LIVE: dict[str, float | Mapping[str, float]] = {
    metrics.CACHE_QUERIES: 4000,
    metrics.CACHE_HITS: 1200,
    metrics.DRAFTS: 300,
    metrics.DRAFT_TOKENS: 600,
    metrics.ACCEPTED: 420,
    metrics.ACCEPTED_PER_POS: {"0": 240, "1": 180},
}


def plan(index: int, *, prompt_tokens: int = PROMPT, answer: str = ANSWER) -> Plan:
    turn1 = ({"role": "user", "content": f"document {index}"},)
    probe = ({"role": "user", "content": f"document {index} what is the code of amber ?"},)
    return Plan(index, turn1, "what is the code of amber ?", answer, probe, prompt_tokens, 2 * BLOCK + 4)


def tokens(*logprobs: float, words: Sequence[str] | None = None, margin: float = 2.0) -> tuple[TokenLogprob, ...]:
    """Chosen tokens with one alternative `margin` nats below each (so `TokenLogprob.margin == margin`)."""
    words = list(words) if words is not None else [f"w{i}" for i in range(len(logprobs))]
    return tuple(
        TokenLogprob(w, lp, ((w, lp), (f"{w}-alt", lp - margin))) for w, lp in zip(words, logprobs, strict=True)
    )


def exchange(
    conversation: int,
    arm: str,
    kind: str,
    *,
    cached: int | None = None,
    text: str = "",
    toks: Sequence[TokenLogprob] = (),
    error: str | None = None,
) -> Exchange:
    return Exchange(
        conversation,
        arm,
        kind,
        f"c{conversation:03d}-{arm}-{kind}",
        text=text,
        tokens=tuple(toks),
        prompt_tokens=None if error else PROMPT,
        cached_tokens=cached,
        error=error,
        status_code=500 if error else 200,
    )


def prom(counters: Counters, *, block_size: int = BLOCK) -> str:
    """Exposition text shaped like vLLM's: `_total` counters with `_created` gauges, labels, the config info."""
    lines = [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",enable_prefix_caching="True",mamba_block_size="16"}} 1.0',
    ]
    base = 'engine="0",model_name="tiny"'
    for name, value in counters.items():
        series = (
            [(f'{base},position="{k}"', v) for k, v in value.items()] if isinstance(value, Mapping) else [(base, value)]
        )
        lines += [f"# HELP {name}_total counter", f"# TYPE {name}_total counter"]
        lines += [f"{name}_total{{{labels}}} {float(v)}" for labels, v in series]
        lines += [f"# HELP {name}_created counter", f"# TYPE {name}_created gauge"]
        lines += [f"{name}_created{{{labels}}} 1.7e9" for labels, _ in series]
    return "\n".join(lines) + "\n"


def snapshot(counters: Counters) -> MetricsSnapshot:
    return metrics.parse(prom(counters))


def delta(before: Counters, after: Counters) -> MetricsDelta:
    return MetricsDelta(snapshot(before), snapshot(after))


def zeros(counters: Counters) -> dict[str, float | Mapping[str, float]]:
    return {k: {p: 0.0 for p in v} if isinstance(v, Mapping) else 0.0 for k, v in counters.items()}


def live_delta(**changes: float | None) -> MetricsDelta:
    """The LIVE treatment delta; `changes` maps a metrics-module constant's name (CACHE_HITS=0) to a new value,
    None removing that counter from both snapshots."""
    after = dict(LIVE)
    for const, value in changes.items():
        name = getattr(metrics, const)
        if value is None:
            after.pop(name)
        else:
            after[name] = value
    return delta(zeros(after), after)


def resumed(
    conversation: int,
    arm: str,
    *,
    cached: int | None = DECODE_HIT,
    hit: Sequence[TokenLogprob] = (),
    fresh: Sequence[TokenLogprob] = (),
    text: str = ANSWER,
) -> list[Exchange]:
    """Turn 1, turn 2 (a hit of `cached` tokens) and turn 2 again with a fresh cache_salt (no reuse)."""
    return [
        exchange(conversation, arm, Kind.TURN1, cached=0, text="a long story"),
        exchange(conversation, arm, Kind.TURN2, cached=cached, toks=hit, text=text),
        exchange(conversation, arm, Kind.TURN2_FRESH, cached=0, toks=fresh or hit, text=text),
    ]


def probe(
    conversation: int,
    *,
    cached: int | None = PROMPT_HIT,
    hit: Sequence[TokenLogprob] = (),
    fresh: Sequence[TokenLogprob] | None = None,
) -> list[Exchange]:
    """The treatment's probe (a hit ending in the prefill-written region) and its no-reuse twin."""
    hit = hit or tokens(-0.1, -0.2, -0.3)
    return [
        exchange(conversation, Arm.TREATMENT, Kind.PROBE, cached=cached, toks=hit, text=ANSWER),
        exchange(conversation, Arm.TREATMENT, Kind.PROBE_FRESH, cached=0, toks=hit if fresh is None else fresh),
    ]


def conversation(conversation: int, *, turn2_cached: int | None = DECODE_HIT) -> list[Exchange]:
    """Everything a healthy treatment/control conversation records."""
    return [
        *resumed(conversation, Arm.TREATMENT, cached=turn2_cached, hit=tokens(-0.1, -0.2)),
        *probe(conversation),
        exchange(conversation, Arm.CONTROL, Kind.TURN2, text=ANSWER),
    ]


def history(
    plans: Iterable[Plan],
    exchanges: Iterable[Exchange],
    deltas: Mapping[str, MetricsDelta] | None = None,
    *,
    block_size: int = BLOCK,
) -> History:
    return History(block_size, tuple(plans), tuple(exchanges), dict(deltas or {}))


def healthy(n: int = 4, *, turn2_cached: int | None = DECODE_HIT, **changes: float | None) -> History:
    """n conversations whose gates all pass; `changes` go to `live_delta` for the treatment."""
    exchanges = [e for i in range(n) for e in conversation(i, turn2_cached=turn2_cached)]
    control = delta(zeros({metrics.CACHE_QUERIES: 0}), {metrics.CACHE_QUERIES: 4000})
    return history([plan(i) for i in range(n)], exchanges, {Arm.TREATMENT: live_delta(**changes), Arm.CONTROL: control})
