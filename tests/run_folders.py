"""Run folders a PASS, a FAIL and an UNKNOWN run would leave, written through the real store and judged by the
real engine (`engine.judge` on the history read back from the folder), for the report's tests.

Histories are built from tests/histories.py: 32 conversations, the reference running 64 (its yardstick), each hit's
deviation from its recomputation set per conversation. A canary API key is given to the store's redactor and
echoed by the "server" into answers, as a server that echoes headers would.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blackbox import metrics
from blackbox.config import RunConfig
from blackbox.engine import judge
from blackbox.history import Arm, Exchange, History, Kind, TokenLogprob
from blackbox.secrets import Redactor
from blackbox.store import RunStore, load_history
from blackbox.verdict import Finding, Status

import histories as h

CANARY = "sk-canary-report-3e9d1a7c55b2f04"
N = 32
URLS = {
    Arm.TREATMENT: "http://127.0.0.1:8601",
    Arm.CONTROL: "http://127.0.0.1:8602",
    Arm.REFERENCE: "http://127.0.0.1:8603",
}
CONFIG = RunConfig(
    treatment=URLS[Arm.TREATMENT], control=URLS[Arm.CONTROL], reference=URLS[Arm.REFERENCE], conversations=N
)
ROLES = [Finding.passed("comparability", "one model"), Finding.passed("roles", "servers match their roles")]


def noise(n: int, base: float = 0.002, step: float = 0.0007) -> list[float]:
    """Deviations a correct engine shows: small, all different, a few exactly 0 (bit-identical)."""
    return [0.0 if i % 9 == 0 else base + step * ((i * 7) % n) for i in range(n)]


def _pair(conv: int, arm: str, shift: float, flip: bool, *, kind: str, cached: int) -> list[Exchange]:
    fresh = h.tokens(-0.5, -0.2, -0.1, -0.3, margin=3.0)
    words = ["w0", "w1", "x" if flip else "w2", "w3"]
    hit = h.tokens(-0.5 - shift, -0.2, -0.1, -0.3, words=words, margin=3.0)
    twin = Kind.TURN2_FRESH if kind == Kind.TURN2 else Kind.PROBE_FRESH
    return [
        h.exchange(conv, arm, kind, cached=cached, toks=hit, text=f"{h.ANSWER} {' '.join(words)}"),
        h.exchange(conv, arm, twin, cached=0, toks=fresh, text=f"{h.ANSWER} w0 w1 w2 w3"),
    ]


def history(treatment: Sequence[float], *, flips: Sequence[int] = (), cache_hits: float | None = None) -> History:
    """Per treatment conversation its decode-region deviation; `flips`: conversations whose hit flips a
    confident token. The reference's 2N conversations and every probe deviate by noise."""
    reference = noise(2 * N, base=0.0025)
    exchanges: list[Exchange] = []
    for conv in range(2 * N):
        arms = [(Arm.REFERENCE, reference[conv], False)]
        if conv < N:
            arms.insert(0, (Arm.TREATMENT, treatment[conv], conv in flips))
        for arm, shift, flip in arms:
            exchanges.append(h.exchange(conv, arm, Kind.TURN1, cached=0, text="a long story"))
            exchanges += _pair(conv, arm, shift, flip, kind=Kind.TURN2, cached=h.DECODE_HIT)
            exchanges += _pair(conv, arm, noise(2 * N)[conv] / 2, False, kind=Kind.PROBE, cached=h.PROMPT_HIT)
        if conv < N:
            exchanges.append(h.exchange(conv, Arm.CONTROL, Kind.TURN2, text=h.ANSWER))
    timed = [
        dataclasses.replace(e, started_s=0.05 * i, elapsed_s=0.2 + 0.01 * (i % 13), request=_request(e))
        for i, e in enumerate(exchanges)
    ]
    quiet = {metrics.CACHE_QUERIES: 8000, metrics.CACHE_HITS: 2400}
    deltas = {
        Arm.TREATMENT: h.live_delta() if cache_hits is None else h.live_delta(CACHE_HITS=cache_hits),
        Arm.CONTROL: h.delta(h.zeros({metrics.CACHE_QUERIES: 0}), {metrics.CACHE_QUERIES: 4000}),
        Arm.REFERENCE: h.delta(h.zeros(quiet), quiet),
    }
    return History(h.BLOCK, tuple(h.plan(i) for i in range(N)), tuple(timed), deltas, yardstick=tuple(
        h.plan(i) for i in range(N, 2 * N)
    ))  # fmt: skip


def _request(e: Exchange) -> dict[str, Any]:
    asks = {"logprobs": True, "top_logprobs": 2} if e.tokens else {}
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"conversation {e.conversation} ({e.kind})"}],
        **asks,
        "cache_salt": "blackbox-test",
    }


def _response(e: Exchange) -> dict[str, Any] | None:
    if not e.ok:
        return None

    def token(t: TokenLogprob) -> dict[str, Any]:
        return {"token": t.token, "logprob": t.logprob, "top_logprobs": [{"token": a, "logprob": v} for a, v in t.top]}

    return {
        "choices": [
            {
                "message": {"role": "assistant", "content": e.text},
                "logprobs": {"content": [token(t) for t in e.tokens]},
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": e.prompt_tokens,
            "completion_tokens": len(e.tokens) or 36,
            "prompt_tokens_details": {"cached_tokens": e.cached_tokens},
        },
        # A server that echoes request headers: the store's redactor must keep the key out of the folder.
        "echo": {"authorization": f"Bearer {CANARY}"},
    }


def write(root: Path, name: str, history: History, config: RunConfig = CONFIG) -> Path:
    """The folder `blackbox run` leaves: written by `RunStore`, judged on what it reads back."""
    store = RunStore(root, name, Redactor(CANARY))
    try:
        store.write_text("command.txt", f"blackbox run --treatment {config.treatment} --conversations {N}\n")
        store.write_json("config.json", config.to_json())
        store.write_json("geometry.json", {"block_size": h.BLOCK, "block_size_source": "test", "max_model_len": 4096})
        store.write_json("preflight.json", [f.to_json() for f in ROLES])
        store.write_json("plans.json", [p.__dict__ for p in history.plans])
        store.write_json("yardstick-plans.json", [p.__dict__ for p in history.yardstick])
        for e in history.exchanges:
            store.record(dataclasses.replace(e, response=_response(e)))
        for arm, d in history.deltas.items():
            store.write_text(f"metrics/{arm}-before.prom", d.before.text)
            store.write_text(f"metrics/{arm}-after.prom", d.after.text)
        store.append_jsonl("retries.jsonl", {"at": 1.5, "server": "treatment", "request": "POST x", "attempt": 1})
        store.close()
        _, stored = load_history(store.path)
        verdict, grades = judge(stored, config, ROLES)
        payload = {**verdict.to_json(), "elapsed_s": 12.0, "graders_used": list(grades.used)}
        payload["graders_not_used"] = [{"grader": g, "why": w} for g, w in grades.not_used]
        store.write_json("verdict.json", payload)
        flagged = {
            int(m["unit"])
            for f in verdict.findings
            if f.status is not Status.PASS
            for m in f.figures.get("mismatches", ())
        } or {0}
        store.write_replays(URLS, (e for e in stored.exchanges if e.conversation in flagged), config.api_key_env)
    finally:
        store.close()
    return store.path


def three(root: Path) -> dict[str, Path]:
    """A PASS, a FAIL (6 hits far beyond the reference, 2 confident flips) and an UNKNOWN (the cache never hit)."""
    fail = noise(N)
    for conv in (3, 8, 13, 21, 27, 30):
        fail[conv] = 0.6 + 0.1 * conv
    return {
        "PASS": write(root, "pass", history(noise(N))),
        "FAIL": write(root, "fail", history(fail, flips=(5, 17))),
        "UNKNOWN": write(root, "unknown", history(noise(N), cache_hits=0)),
    }


def stored_verdict(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "verdict.json").read_text()))
