"""Time a burst of identical-shape chat requests against several servers at once, and read their metrics.

    python -m servers.gpu.probe --log-root /tmp/bbgpu/logs treatment=http://127.0.0.1:8100 ...

For each server: `--requests` concurrent greedy completions of a `--prompt-tokens` word prompt, each asking
for `--max-tokens`; wall time per request, generated tokens, and the spec-decode and prefix-cache counters
before and after. A server that does not answer within `--timeout` gets SIGUSR1 on every process of its
launch group (servers.gpu.diag dumps their stacks into its log), so a crawl can be located afterwards.
Prints one JSON object per server, and writes them to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from blackbox.vocabulary import WORDS

_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
)
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_LINE = re.compile(r"^([a-z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$")


def _metrics(text: str) -> dict[str, float]:
    """Counters summed over label sets, per-position acceptance keyed by position, block size."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in _COUNTERS:
            out[name] = out.get(name, 0.0) + value
        elif name == _PER_POSITION:
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                key = f"accepted_pos{pos.group(1)}"
                out[key] = out.get(key, 0.0) + value
        elif name == "vllm:cache_config_info":
            block = re.search(r'block_size="(\d+)"', labels)
            if block:
                out["block_size"] = float(block.group(1))
    return out


def _prompt(i: int, tokens: int) -> str:
    # Distinct per request (no prefix sharing between the burst's requests), deterministic.
    return " ".join(WORDS[(i * 7919 + j * 104729) % len(WORDS)] for j in range(tokens))


async def _one(client: httpx.AsyncClient, url: str, i: int, args: argparse.Namespace) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": _prompt(i, args.prompt_tokens)}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    began = time.monotonic()
    try:
        r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=args.timeout)
        r.raise_for_status()
        usage = r.json().get("usage", {})
        return {"s": time.monotonic() - began, "tokens": usage.get("completion_tokens", 0)}
    except (httpx.HTTPError, ValueError) as exc:
        return {"s": time.monotonic() - began, "tokens": 0, "error": f"{type(exc).__name__}: {exc}"[:300]}


async def _probe(name: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        try:
            before = _metrics((await client.get(f"{url}/metrics", timeout=10)).text)
        except httpx.HTTPError as exc:
            return {"name": name, "url": url, "error": f"no metrics: {exc}"}
        began = time.monotonic()
        results = await asyncio.gather(*(_one(client, url, i, args) for i in range(args.requests)))
        wall = time.monotonic() - began
        try:
            after = _metrics((await client.get(f"{url}/metrics", timeout=10)).text)
        except httpx.HTTPError:
            after = {}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k != "block_size"}
    drafts = delta.get("vllm:spec_decode_num_drafts_total", 0.0)
    report: dict[str, Any] = {
        "name": name,
        "url": url,
        "block_size": after.get("block_size"),
        "wall_s": round(wall, 2),
        "requests": len(results),
        "failed": sum(1 for r in results if "error" in r),
        "tokens": sum(r["tokens"] for r in results),
        "tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1) if wall > 0 else None,
        "max_request_s": round(max(r["s"] for r in results), 2),
        "acceptance_by_position": [
            round(delta[f"accepted_pos{p}"] / drafts, 3) for p in range(8) if f"accepted_pos{p}" in delta and drafts
        ],
        "errors": sorted({r["error"] for r in results if "error" in r})[:3],
    }
    if report["failed"] and args.log_root is not None:
        report["stacks_requested"] = _dump_stacks(args.log_root, url)
    return report


def _dump_stacks(log_root: Path, url: str) -> list[int]:
    """SIGUSR1 to the launch group of the server at `url` (its pids.json under `log_root`)."""
    port = int(url.rsplit(":", 1)[1])
    signalled = []
    for pids in log_root.glob("*/pids.json"):
        for entry in json.loads(pids.read_text()).values():
            if entry.get("port") == port:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(entry["pgid"]), signal.SIGUSR1)
                    signalled.append(int(entry["pgid"]))
    return signalled


async def _main(targets: Sequence[tuple[str, str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(_probe(name, url, args) for name, url in targets)))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servers.gpu.probe", description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="+", help="NAME=URL")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=90)
    p.add_argument("--log-root", type=Path, help="folder of launch log dirs (pids.json), for stack dumps")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    targets = [tuple(t.split("=", 1)) for t in args.targets]
    reports = asyncio.run(_main([(n, u) for n, u in targets], args))
    for report in reports:
        print(json.dumps(report), flush=True)
    if args.out is not None:
        with args.out.open("a") as f:
            for report in reports:
                f.write(json.dumps(report) + "\n")
    return 0 if all(not r.get("failed") and "error" not in r for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
