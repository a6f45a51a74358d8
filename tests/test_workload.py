"""Conversation planning against fake token counters: the prompt lands just under a block boundary."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from blackbox import errors
from blackbox.history import Plan
from blackbox.vocabulary import FILLER
from blackbox.workload import (
    Shape,
    TokenCounter,
    _document,
    _largest_fitting,
    plan_conversation,
    question_for,
    turn1_body,
    turn1_messages,
    turn2_body,
    turn2_messages,
)

TEMPLATE = 5  # tokens a chat template adds around the messages


async def count_words(messages: Sequence[Mapping[str, str]]) -> int:
    """A word-level tokenizer, like the tiny CPU model's: one token per whitespace-separated word."""
    return TEMPLATE + sum(len(m["content"].split()) for m in messages)


async def count_subwords(messages: Sequence[Mapping[str, str]]) -> int:
    """A subword-ish tokenizer: long words cost several tokens, so one more word can overshoot by up to 4."""
    return TEMPLATE + sum(1 + len(w) // 3 for m in messages for w in m["content"].split())


async def plan(
    index: int = 0,
    seed: int = 0,
    shape: Shape | None = None,
    block: int = 128,
    *,
    count: TokenCounter = count_words,
    max_model_len: int = 4096,
) -> Plan:
    return await plan_conversation(index, seed, shape or Shape(), block, max_model_len, count)


async def count_lumpy(messages: Sequence[Mapping[str, str]]) -> int:
    """Token costs that vary from word to word (1-4) without following their length: no straight line fits."""
    return TEMPLATE + sum(1 + sum(map(ord, w)) % 4 for m in messages for w in m["content"].split())


def counted(count: TokenCounter) -> tuple[TokenCounter, list[int]]:
    calls: list[int] = []

    async def wrapped(messages: Sequence[Mapping[str, str]]) -> int:
        calls.append(1)
        return await count(messages)

    return wrapped, calls


async def sized_by_bisection(index: int, seed: int, shape: Shape, block: int, count: TokenCounter) -> tuple[str, str]:
    """The sizing as it was until 2026-12-07, kept as the oracle: bisection over sentences, then filler words one at
    a time until one overshoots; turn 1's text and the question asked."""
    target = shape.prompt_blocks * block - shape.margin
    rng = random.Random(f"blackbox:{seed}:{index}")
    doc = _document(rng, shape, sentences=max(8, target // 4))
    lo, hi = 0, len(doc.sentences)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if await count(turn1_messages(doc.text(mid))) <= target:
            lo = mid
        else:
            hi = mid - 1
    text = doc.text(lo)
    for _ in range(64):
        longer = f"{text} {rng.choice(FILLER)}"
        if await count(turn1_messages(longer)) > target:
            break
        text = longer
    present = [n for n in doc.needles if f"the code of {n[0]} is" in text]
    return turn1_messages(text)[0]["content"], question_for(rng.choice(present)[0])


@pytest.mark.parametrize("count", [count_words, count_subwords, count_lumpy])
async def test_plans_are_the_ones_bisection_finds_in_fewer_tokenize_calls(count: TokenCounter) -> None:
    # Each /tokenize call is a request to the server under test during the run: the search must find exactly the
    # prompt the slower search found (runs stay comparable across versions) with fewer of them.
    ours, ours_calls = counted(count)
    theirs, theirs_calls = counted(count)
    cases = [
        (i, seed, Shape(prompt_blocks=b, margin=m), block)
        for i in range(3)
        for seed in range(3)
        for b, m, block in [(3, 16, 128), (2, 8, 64), (4, 40, 288)]
    ]
    for index, seed, shape, block in cases:
        p = await plan_conversation(index, seed, shape, block, 32768, ours)
        assert (p.turn1_messages[0]["content"], p.question) == await sized_by_bisection(
            index, seed, shape, block, theirs
        )
    assert len(ours_calls) < 0.75 * len(theirs_calls)


@pytest.mark.parametrize(
    "values",
    [
        [3 * n + 7 for n in range(200)],  # a straight line
        [n * n for n in range(200)],  # curving away from the first slope
        [0] * 150 + [1000 + n for n in range(50)],  # flat, then a cliff: interpolation's worst case
        [n // 9 for n in range(200)],  # long plateaus
        [10 + 2 * n + (n * 7919) % 5 for n in range(200)],  # a line with noise of a few tokens
    ],
)
@pytest.mark.parametrize("target", [0, 5, 99, 150, 1100, 10**6])
async def test_the_search_finds_the_largest_fitting_step_within_twice_bisections_calls(
    values: list[int], target: int
) -> None:
    calls: list[int] = []

    async def measure(n: int) -> int:
        calls.append(n)
        return values[n]

    hi = len(values) - 1
    found, at = await _largest_fitting(measure, None, hi, values[hi], target, values[hi] / hi)
    fitting = [n for n in range(1, hi + 1) if values[n] <= target]
    assert found == (max(fitting) if fitting else 0)
    assert at is None if found == 0 else at == values[found]
    assert len(calls) <= 2 * hi.bit_length() + 2
    assert len(set(calls)) == len(calls)  # nothing counted twice


@pytest.mark.parametrize(("prompt_blocks", "margin", "block"), [(3, 16, 128), (2, 8, 64), (4, 16, 256), (3, 4, 16)])
async def test_word_counter_lands_exactly_on_the_target(prompt_blocks: int, margin: int, block: int) -> None:
    shape = Shape(prompt_blocks=prompt_blocks, margin=margin)
    p = await plan(shape=shape, block=block)
    target = prompt_blocks * block - margin
    assert p.turn1_prompt_tokens == target
    assert await count_words(p.turn1_messages) == p.turn1_prompt_tokens  # the recorded count is the real one
    assert p.turn1_max_tokens == margin + shape.answer_blocks * block + block // 2


@pytest.mark.parametrize("seed", range(5))
async def test_subword_counter_lands_at_or_just_under_the_target(seed: int) -> None:
    p = await plan(seed=seed, count=count_subwords)
    target = 3 * 128 - 16
    assert target - 5 < p.turn1_prompt_tokens <= target
    assert await count_subwords(p.turn1_messages) == p.turn1_prompt_tokens


async def test_turn1_ends_inside_the_last_prompt_block_so_decoding_writes_the_next() -> None:
    shape = Shape()
    p = await plan(shape=shape)
    assert (shape.prompt_blocks - 1) * 128 < p.turn1_prompt_tokens < shape.prompt_blocks * 128
    # Turn 1 decodes past the boundary and on for answer_blocks whole blocks.
    assert p.turn1_prompt_tokens + p.turn1_max_tokens >= (shape.prompt_blocks + shape.answer_blocks) * 128


async def test_plans_are_deterministic_for_a_seed_and_differ_across_seeds() -> None:
    a, again = await plan(index=2, seed=7), await plan(index=2, seed=7)
    assert a == again
    others = [await plan(index=2, seed=s) for s in (8, 9)] + [await plan(index=3, seed=7)]
    for other in others:
        assert other.turn1_messages != a.turn1_messages
    assert len({(p.question, p.answer) for p in [a, *others]}) > 1


@pytest.mark.parametrize("seed", range(8))
async def test_the_needle_asked_about_is_in_the_document(seed: int) -> None:
    p = await plan(seed=seed, index=seed)
    document = p.turn1_messages[0]["content"]
    name = p.question.removeprefix("what is the code of ").split(" ?")[0]
    assert f"the code of {name} is {p.answer} ." in document
    assert p.question in p.probe_messages[0]["content"]
    # The probe shares turn 1's document, so its cache hit ends in the prefill-written region.
    assert p.probe_messages[0]["content"].startswith(document.removesuffix("now write a long story about the record ."))


async def test_a_model_too_short_for_the_conversation_is_geometry_unsupported() -> None:
    with pytest.raises(errors.GeometryUnsupported) as info:
        await plan(max_model_len=512)
    assert "max_model_len is 512" in str(info.value)
    assert "--max-model-len" in info.value.hint


async def test_a_prompt_too_small_for_any_fact_is_geometry_unsupported() -> None:
    # 2 blocks of 16 minus 16: a 16-token prompt cannot hold the instructions and one fact.
    with pytest.raises(errors.GeometryUnsupported):
        await plan(shape=Shape(prompt_blocks=2, margin=16), block=16)


async def test_margin_at_or_over_the_prompt_is_geometry_unsupported() -> None:
    with pytest.raises(errors.GeometryUnsupported):
        await plan(shape=Shape(prompt_blocks=1, margin=128))


def test_turn1_body_forces_the_answer_length() -> None:
    shape = Shape(top_logprobs=3)
    p = Plan(0, ({"role": "user", "content": "doc"},), "q ?", "alpha", (), 368, 272)
    body = turn1_body(p, shape)
    assert body["max_tokens"] == body["min_tokens"] == 272
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0.0
    assert body["logprobs"] is True and body["top_logprobs"] == 3
    assert body["messages"] == [{"role": "user", "content": "doc"}]
    assert "cache_salt" not in body


def test_turn2_resends_turn1_and_the_answer_then_asks() -> None:
    p = Plan(0, ({"role": "user", "content": "doc"},), "what is the code of amber ?", "alpha", (), 368, 272)
    messages = turn2_messages(p, "a long story")
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "a long story"
    assert messages[2]["content"] == p.question
    shape = Shape()
    body = turn2_body(messages, shape, salt="s-1")
    assert body["cache_salt"] == "s-1"
    assert body["max_tokens"] == shape.turn2_max_tokens
    assert "min_tokens" not in body and "ignore_eos" not in body
    assert turn2_body(messages, shape, probe=True)["max_tokens"] == shape.probe_max_tokens
    assert "cache_salt" not in turn2_body(messages, shape)
