"""Would scoring each preemption answer in a prefill (teacher-forced) grade it better than its recomputation?

    python bench/teacher_forced.py --treatment URL --reference URL --tokenizer DIR RUN_FOLDER...

The preemption probe's grader compares each turn 1 with the same request answered again alone, up to the first
token where the two part; about a third of a correct engine's answers part before their end, so a resume after
that token is not graded. Teacher-forced scoring sends the prompt and the answer's own tokens as one prompt with
`prompt_logprobs` (no hit: such a request skips the prefix cache) and compares every position's logprobs with the
answer's own (`TokenLogprob.gap`, chosen and top-k), so every position is graded. This script re-scores the turn 1s
of kept preemption run folders on clean servers of the same profile (each arm's answers on that arm's server), and
grades both samples with the probe's own statistics (`evidence.judge_samples`, the tests every grader shares). The
kept runs did not ask for token ids, so the answer's token strings are mapped back to ids through the model's
tokenizer (a word-level vocabulary on the tiny model: one id a string). Prints, per run, both graders' p-values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blackbox.client import parse_chat
from blackbox.compare import deviation
from blackbox.evidence import Sample, judge_samples
from blackbox.history import TokenLogprob

TURN1, AGAIN = "preempt-a", "preempt-a-fresh"
TOP = 5  # the probe's top_logprobs


async def post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    for _ in range(5):  # an idle keep-alive connection the server closed: once more
        try:
            r = await client.post(url, json=body)
            r.raise_for_status()
            return r.json()
        except httpx.TransportError:
            await asyncio.sleep(1)
    raise RuntimeError(f"{url} did not answer")


async def scored(client: httpx.AsyncClient, url: str, ex: dict[str, Any], ids: dict[str, int]) -> list[TokenLogprob]:
    """The answer's own tokens as a prefill's prompt_logprobs, one TokenLogprob a position."""
    model = ex["request"].get("model") or "tiny"
    prompt = (await post(client, f"{url}/tokenize", {"model": model, "messages": ex["request"]["messages"]}))["tokens"]
    content = ex["response"]["choices"][0]["logprobs"]["content"]
    answer = [ids[d["token"]] for d in content]
    body = {"model": model, "prompt": prompt + answer, "max_tokens": 1, "prompt_logprobs": TOP, "temperature": 0.0}
    out = await post(client, f"{url}/v1/completions", body)
    logprobs = out["choices"][0].get("prompt_logprobs") or out["prompt_logprobs"]
    positions = []
    for i, token in enumerate(answer):
        entry = logprobs[len(prompt) + i]
        top = sorted((v for v in entry.values() if v["rank"] <= TOP), key=lambda v: v["rank"])
        positions.append(
            TokenLogprob(
                content[i]["token"],
                entry[str(token)]["logprob"],
                tuple((v["decoded_token"], v["logprob"]) for v in top),
            )
        )
    return positions


async def run_folder(folder: Path, urls: dict[str, str], ids: dict[str, int], margin: float) -> dict[str, Any]:
    exchanges = [json.loads(line) for line in (folder / "exchanges.jsonl").open()]
    again = {(e["arm"], e["conversation"]): e for e in exchanges if e["kind"] == AGAIN and e["ok"]}
    turn1 = [e for e in exchanges if e["kind"] == TURN1 and e["ok"] and (e["arm"], e["conversation"]) in again]
    bound = asyncio.Semaphore(2)  # two at a time: the scoring must not be preempted itself

    async with httpx.AsyncClient(timeout=300) as client:

        async def one(e: dict[str, Any]) -> tuple[str, int, dict[str, float]]:
            async with bound:
                forced = await scored(client, urls[e["arm"]], e, ids)
            answer = parse_chat(e["response"])["tokens"]
            recomputed = parse_chat(again[(e["arm"], e["conversation"])]["response"])["tokens"]
            whole = max((a.gap(b) for a, b in zip(answer, forced, strict=True)), default=0.0)
            return (
                e["arm"],
                e["conversation"],
                {"recomputation": deviation(answer, recomputed, margin), "teacher-forced": whole},
            )

        rows = await asyncio.gather(*(one(e) for e in turn1))
    result: dict[str, Any] = {"run": folder.name}
    for name in ("recomputation", "teacher-forced"):
        t = [Sample(conv, TURN1, dev[name], False) for arm, conv, dev in rows if arm == "treatment"]
        y = [Sample(conv, TURN1, dev[name], False) for arm, conv, dev in rows if arm == "reference"]
        finding = judge_samples(
            name, t, y, alpha=0.01, what="turn 1s", against="the reference's", runs=len(t), hint="-", exact=False
        )
        result[name] = {
            "status": finding.status.value,
            "p_values": finding.figures.get("p_values"),
            "treatment_top": sorted((s.deviation for s in t), reverse=True)[:6],
            "reference_max": max(s.deviation for s in y),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--treatment", required=True)
    parser.add_argument("--reference", required=True)
    parser.add_argument("--tokenizer", required=True, help="the model folder (its tokenizer.json)")
    parser.add_argument("--hard-margin", type=float, default=1.0)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    from tokenizers import Tokenizer  # vLLM's own dependency, in the server venv

    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    ids: dict[str, int] = {}
    for i in range(tokenizer.get_vocab_size()):
        ids.setdefault(tokenizer.decode([i], skip_special_tokens=False), i)
    urls = {"treatment": args.treatment.rstrip("/"), "reference": args.reference.rstrip("/")}
    for folder in args.runs:
        print(json.dumps(asyncio.run(run_folder(folder, urls, ids, args.hard_margin))), flush=True)


if __name__ == "__main__":
    main()
