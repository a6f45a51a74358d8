"""Seeded conversations sized in blocks of the server's prefix cache.

Turn 1 is a document of facts ("needles") whose prompt ends `margin` tokens below a block boundary, and the
answer is forced (min_tokens + ignore_eos) to run on for `answer_blocks` more blocks, so the blocks after the
prompt are written while the drafter is speculating. Turn 2 re-sends turn 1 and its answer and asks for one
needle. The probe shares only turn 1's document, so its hit ends in the prefill-written region.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from blackbox.errors import GeometryUnsupported
from blackbox.history import Plan
from blackbox.vocabulary import CODE_WORDS, FILLER, NAMES

__all__ = [
    "MAX_RESUMES",
    "Messages",
    "Shape",
    "fact_document",
    "plan_conversation",
    "question_for",
    "resume_cut",
    "turn1_body",
    "turn1_messages",
    "turn2_messages",
]

Messages = tuple[Mapping[str, str], ...]
TokenCounter = Callable[[Sequence[Mapping[str, str]]], Awaitable[int]]

MAX_RESUMES = 4  # each extra resume lengthens turn 1 by a block and adds two short requests per arm
_INSTRUCTION = "read the record and remember every code ."
_TELL = "now write a long story about the record ."


@dataclass(frozen=True)
class Shape:
    """How a conversation is laid out over the cache's blocks."""

    prompt_blocks: int = 3
    margin: int = 16  # turn 1's prompt ends this many tokens below a block boundary
    answer_blocks: int = 3  # whole blocks turn 1 decodes past its prompt's boundary (see turn1_tokens)
    needles: int = 6
    code_words: int = 3
    turn2_max_tokens: int = 32
    probe_max_tokens: int = 24
    top_logprobs: int = 5
    # Decode-written boundaries each conversation resumes from: turn 2 on the whole answer, and `resumes - 1`
    # more on the answer cut a block, two blocks, ... earlier (docs/statistics.md, "Several resumes").
    resumes: int = 1

    def turn1_tokens(self, block_size: int) -> int:
        """Decode past the boundary, then `answer_blocks` whole blocks (one more per extra resume), then half a
        block more.

        With MTP the lookup drops the last matched block, so a decode-written checkpoint is reachable only if
        a later one is cached too; and a boundary crossed inside an accepted draft gets no checkpoint at all
        (measured: about 60% of decode boundaries are checkpointed on the CPU pair), so turn 1 crosses
        several boundaries past the one the trigger needs."""
        return self.margin + (self.answer_blocks + self.resumes - 1) * block_size + block_size // 2

    def resume_cuts(self, block_size: int) -> tuple[int, ...]:
        """Answer tokens kept by each extra resume: the answer ends half a block past a boundary, and so does each
        cut, `j` blocks earlier, so each resume's hit lands `j` blocks below turn 2's."""
        whole = self.turn1_tokens(block_size)
        return tuple(whole - j * block_size for j in range(1, self.resumes))


@dataclass(frozen=True)
class _Document:
    needles: tuple[tuple[str, str], ...]  # (name, code)
    sentences: tuple[str, ...]

    def text(self, filler_sentences: int) -> str:
        return " ".join(self.sentences[:filler_sentences])


def _document(rng: random.Random, shape: Shape, sentences: int) -> _Document:
    names = rng.sample(NAMES, shape.needles)
    needles = tuple((n, " ".join(rng.choice(CODE_WORDS) for _ in range(shape.code_words))) for n in names)
    facts = [f"the code of {n} is {c} ." for n, c in needles]
    filler = [" ".join(rng.choice(FILLER) for _ in range(rng.randint(6, 14))) + " ." for _ in range(sentences)]
    # Facts spread through the document; the question asks only about one that made it into the prompt.
    body: list[str] = []
    step = max(1, sentences // (2 * len(facts)))
    for i, sentence in enumerate(filler):
        if facts and i % step == 0:
            body.append(facts.pop(0))
        body.append(sentence)
    body.extend(facts)
    return _Document(needles, tuple(body))


def fact_document(rng: random.Random, shape: Shape, sentences: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    """A whole document of `sentences` filler sentences and its needles, as conversations draw them (the tiny
    recall model is trained on these)."""
    doc = _document(rng, shape, sentences)
    return doc.text(len(doc.sentences)), doc.needles


def turn1_messages(doc: str) -> Messages:
    return ({"role": "user", "content": f"{_INSTRUCTION} {doc} {_TELL}"},)


def _probe(doc: str, name: str) -> Messages:
    return (
        {
            "role": "user",
            "content": f"{_INSTRUCTION} {doc} what is the code of {name} ? answer with only the code .",
        },
    )


def question_for(name: str) -> str:
    return f"what is the code of {name} ? answer with only the code ."


def turn2_messages(plan: Plan, answer: str) -> Messages:
    return (
        *plan.turn1_messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": plan.question},
    )


async def plan_conversation(
    index: int, seed: int, shape: Shape, block_size: int, max_model_len: int, count: TokenCounter
) -> Plan:
    """Find the document length whose turn-1 prompt ends `margin` tokens below a boundary (`_largest_fitting`)."""
    target = shape.prompt_blocks * block_size - shape.margin
    turn2_budget = target + shape.turn1_tokens(block_size) + 64 + shape.turn2_max_tokens
    if turn2_budget > max_model_len or target <= 0:
        raise GeometryUnsupported(
            f"a conversation needs ~{turn2_budget} tokens (prompt {shape.prompt_blocks} blocks of {block_size}, "
            f"answer {shape.answer_blocks} blocks) but max_model_len is {max_model_len}",
            hint="lower --prompt-blocks/--answer-blocks, or serve with a larger --max-model-len",
        )
    rng = random.Random(f"blackbox:{seed}:{index}")
    doc = _document(rng, shape, sentences=max(8, target // 4))
    whole = len(doc.sentences)
    at_whole = await count(turn1_messages(doc.text(whole)))
    if at_whole < target:
        raise GeometryUnsupported(f"could not write a {target}-token document", hint="lower --prompt-blocks")
    # The largest sentence count whose prompt fits under the target; none is measured at 0 (the search assumes it
    # fits, and a prompt that does not ends with no fact in it, below).
    per_char = at_whole / max(1, len(doc.text(whole)))
    lo, at_lo = await _largest_fitting(
        lambda n: count(turn1_messages(doc.text(n))), None, whole, at_whole, target, at_whole / max(1, whole)
    )
    text, tokens = await _pad(doc.text(lo), at_lo, target, rng, count, per_char)
    present = [n for n in doc.needles if f"the code of {n[0]} is" in text]
    if not present:
        raise GeometryUnsupported(
            f"a {target}-token prompt has no room for a fact after the instructions", hint="raise --prompt-blocks"
        )
    name, code = rng.choice(present)
    return Plan(
        index=index,
        turn1_messages=turn1_messages(text),
        question=question_for(name),
        answer=code,
        probe_messages=_probe(text, name),
        turn1_prompt_tokens=tokens,
        turn1_max_tokens=shape.turn1_tokens(block_size),
    )


_PAD_WORDS = 64


async def _pad(
    text: str, at_text: int | None, target: int, rng: random.Random, count: TokenCounter, per_char: float
) -> tuple[str, int]:
    """Add single filler words until the prompt is as close under the target as one more word allows; the text and
    its token count. The words are the ones drawn one at a time until the first that overshoots (at most 64), and
    `rng` is left as that loop leaves it, so a plan is the same whichever way the count is searched."""
    state = rng.getstate()
    words = [rng.choice(FILLER) for _ in range(_PAD_WORDS)]

    def padded(k: int) -> str:
        return text + "".join(f" {w}" for w in words[:k])

    per_word = per_char * (1 + sum(map(len, FILLER)) / len(FILLER))
    k, at_k = await _largest_fitting(
        lambda k: count(turn1_messages(padded(k))), at_text, _PAD_WORDS, None, target, per_word
    )
    rng.setstate(state)
    for _ in range(min(k + 1, _PAD_WORDS)):  # the words the one-at-a-time loop drew, the overshooting one too
        rng.choice(FILLER)
    return padded(k), at_k if at_k is not None else await count(turn1_messages(padded(k)))


async def _largest_fitting(
    measure: Callable[[int], Awaitable[int]],
    at_lo: int | None,
    hi: int,
    at_hi: int | None,
    target: int,
    slope: float,
) -> tuple[int, int | None]:
    """The largest n in [0, hi] whose measure is at most `target`, and its measure where measured, for a measure
    that never falls as n grows; 0 is taken to fit (`at_lo`: its measure, if known). Bisection's answer in fewer
    /tokenize calls: a prompt's tokens grow nearly linearly with its sentences or words, so each guess extrapolates
    from the fitting end (else the other) along the slope of the last two counts (`slope` tokens a step until there
    are two). Once a search has taken as many calls as bisection would, it bisects, so an odd tokenizer costs at
    most about twice as many."""
    if at_hi is not None and at_hi <= target:
        return hi, at_hi
    lo = 0
    over = hi if at_hi is not None else hi + 1  # the smallest n known not to fit, or one past the range
    last: list[tuple[int, int]] = [(hi, at_hi)] if at_hi is not None else []
    calls, patience = 0, (over - lo).bit_length() + 1
    while over - lo > 1:
        if calls >= patience:
            guess = (lo + over) // 2
        else:
            if len(last) == 2 and last[0][1] != last[1][1]:  # every guess is a new n; a plateau gives no slope
                slope = (last[1][1] - last[0][1]) / (last[1][0] - last[0][0])
            if at_lo is not None or at_hi is None:
                guess = lo + math.floor((target - (at_lo or 0)) / slope)
            else:
                guess = math.floor(over - (at_hi - target) / slope)
            guess = min(max(guess, lo + 1), over - 1)
        value = await measure(guess)
        calls += 1
        last = [*last[-1:], (guess, value)]
        if value <= target:
            lo, at_lo = guess, value
        else:
            over, at_hi = guess, value
    return lo, at_lo


def resume_cut(text: str, tokens: Sequence[str], keep: int) -> str:
    """The answer's text up to its first `keep` tokens. Token strings are matched along the text in order (a
    byte-level BPE token carries its own space; a word-level one is found past the separator); where they cannot
    be followed, the cut falls at the same share of the text. Either way the hit's length is read back from
    cached_tokens, not assumed."""
    if keep >= len(tokens):
        return text
    pos = 0
    for token in tokens[:keep]:
        piece = token.replace("\u2581", " ").replace("\u0120", " ").strip()
        if not piece:
            continue
        at = text.find(piece, pos)
        if at < 0 or at - pos > len(token) + 2:
            return text[: round(len(text) * keep / len(tokens))].rstrip()
        pos = at + len(piece)
    return text[:pos]


def turn1_body(plan: Plan, shape: Shape) -> dict[str, object]:
    return {
        "messages": list(plan.turn1_messages),
        **_sampling(shape),
        "max_tokens": plan.turn1_max_tokens,
        "min_tokens": plan.turn1_max_tokens,
        "ignore_eos": True,
    }


def turn2_body(messages: Messages, shape: Shape, *, salt: str | None = None, probe: bool = False) -> dict[str, object]:
    body: dict[str, object] = {
        "messages": list(messages),
        **_sampling(shape),
        "max_tokens": shape.probe_max_tokens if probe else shape.turn2_max_tokens,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _sampling(shape: Shape) -> dict[str, object]:
    return {"temperature": 0.0, "logprobs": True, "top_logprobs": shape.top_logprobs, "seed": 0}
