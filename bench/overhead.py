"""blackbox's own cost against the physical limit: the same requests replayed by a plain httpx loop.

    python bench/overhead.py [--conversations 32] [--seeds 1] [--base-port 8300]
        [--keep-runs runs/bench-overhead]
    python bench/overhead.py --treatment URL --control URL --reference URL [--label gpu-tiny] ...
    python bench/overhead.py --rebuild-table

Starts the clean CPU trio (treatment, control, reference: bench/faults.py's `clean` case), or, given all three
URLs (loopback only: the replay must not cross a network the run did not), measures those servers and starts
none: e.g. the gpu-tiny triple on the lent GPU machine, whose 16 cores the client does not share with the servers
as it does the build machine's two. Each row records which servers it measured (`servers`: "cpu trio", or the
--label with the device `nvidia-smi` names). Then for each seed:

0. a first `blackbox run` of the seed, kept as the *cold* figures only: on fresh servers torch inductor compiles
   kernels at each new batch shape (requests wait 15-40 s at first), which would be charged to whichever side
   ran first;
1. `blackbox run` (through `engine.run`, as the CLI does) of the multiturn probe, while a sampler reads every
   server's `vllm:num_requests_running` and `vllm:num_requests_waiting` every 0.2 s: a server is idle at a
   sample where both are 0. The idle fraction is over the conversation phase (first request sent to last answer
   back), since before it the servers are only asked for their settings and token counts, and the whole run's
   wall time is given as well;
2. the raw replay: every chat request the run recorded (`exchanges.jsonl`, bodies as sent), with its cache_salt
   renamed so the cache starts as cold as it did for the run, sent by a bare `httpx.AsyncClient` loop: each
   conversation's requests on each server in the order the run sent them, servers concurrently, at most the
   run's `--concurrency` conversations at once (blackbox's own bound, 8). The replay knows every answer in
   advance, so it needs no planning (`/tokenize`), no checks of the servers, no /metrics settling and no
   grading: what is left is the servers' own time for the same work.

The ratio blackbox wall / replay wall is blackbox's overhead (target at most 1.03); the idle fraction says how
much of the run the servers waited for blackbox (target at most 10%). One line per seed goes to
bench/results/overhead.jsonl (with its command, date and commit); bench/results/overhead.md is rebuilt from all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import ipaddress
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from blackbox.engine import run
from blackbox.metrics import parse
from blackbox.store import RunStore

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "bench/faults.py")
assert _spec is not None and _spec.loader is not None
faults = importlib.util.module_from_spec(_spec)
sys.modules["bench_faults"] = faults
_spec.loader.exec_module(faults)

RESULTS = Path(__file__).resolve().parent / "results"
RUNS_FILE = RESULTS / "overhead.jsonl"
TABLE_FILE = RESULTS / "overhead.md"
SAMPLE_S = 0.2
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")
TRANSIENT = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
ATTEMPTS = 4


class Sampler:
    """Polls each server's queue gauges; `idle(role, a, b)` is the fraction of samples in [a, b] with none."""

    def __init__(self, urls: Mapping[str, str]) -> None:
        self.urls = dict(urls)
        self.samples: dict[str, list[tuple[float, bool]]] = defaultdict(list)  # role -> (monotonic, busy)
        self._stop = asyncio.Event()

    async def loop(self) -> None:
        async with httpx.AsyncClient(timeout=5) as http:
            while not self._stop.is_set():
                await asyncio.gather(*(self._one(http, role, url) for role, url in self.urls.items()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), SAMPLE_S)

    async def _one(self, http: httpx.AsyncClient, role: str, url: str) -> None:
        try:
            snapshot = parse((await http.get(f"{url}/metrics")).text)
        except httpx.HTTPError:
            return
        busy = sum(snapshot.value(name) or 0.0 for name in BUSY) > 0
        self.samples[role].append((time.monotonic(), busy))

    def stop(self) -> None:
        self._stop.set()

    def idle(self, role: str, start: float, end: float) -> float | None:
        inside = [busy for t, busy in self.samples[role] if start <= t <= end]
        return None if not inside else 1 - sum(inside) / len(inside)


async def measured_run(config: Any, store: RunStore) -> tuple[Any, float, Sampler, float, float]:
    """The run under the sampler; also this process's CPU seconds, which on the CPU pair the servers lose."""
    roles = {"treatment": config.treatment, "control": config.control, "reference": config.reference}
    sampler = Sampler({role: url for role, url in roles.items() if url})
    task = asyncio.create_task(sampler.loop())
    started, cpu = time.monotonic(), time.process_time()
    try:
        result = await run(config, store)
    finally:
        wall, cpu = time.monotonic() - started, time.process_time() - cpu
        sampler.stop()
        await task
    return result, wall, sampler, started, cpu


async def sampled_replay(
    exchanges: list[dict[str, Any]],
    urls: Mapping[str, str],
    concurrency: int,
    salt: str,
    timings: list[dict[str, Any]],
    retries: list[str] | None = None,
) -> tuple[float, Sampler, float, float]:
    """The replay under the same idle sampler as the blackbox run, so both sides pay its /metrics polling."""
    sampler = Sampler(urls)
    task = asyncio.create_task(sampler.loop())
    started, cpu = time.monotonic(), time.process_time()
    try:
        wall = await replay(exchanges, urls, concurrency, salt, timings, retries)
    finally:
        cpu = time.process_time() - cpu
        sampler.stop()
        await task
    return wall, sampler, started, cpu


def conversation_phase(exchanges: list[dict[str, Any]], started: float) -> tuple[float, float]:
    """Monotonic [first request sent, last answer back] of the recorded chat requests."""
    first = min(e["started_s"] for e in exchanges)
    last = max(e["started_s"] + e["elapsed_s"] for e in exchanges)
    return started + first, started + last


def latencies(run: list[dict[str, Any]], replayed: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Mean seconds a request of each server and kind took: [in the run, in the replay]."""
    sides: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for side, rows in enumerate((run, replayed)):
        for r in rows:
            sides[f"{r['arm']} {r.get('kind')}"][side].append(r["elapsed_s"])
    return {k: [round(statistics.mean(v), 2) if v else 0.0 for v in pair] for k, pair in sorted(sides.items())}


def chats(folder: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (folder / "exchanges.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("request") and r.get("started_s") is not None and r.get("ok")]


async def replay(
    exchanges: list[dict[str, Any]],
    urls: Mapping[str, str],
    concurrency: int,
    salt: str,
    timings: list[dict[str, Any]],
    retries: list[str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> float:
    """Every recorded request again, in the run's order per (conversation, server), with a fresh cache_salt; a
    control request waits for its conversation's first treatment answer, as the run's must."""
    chains: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for e in sorted(exchanges, key=lambda e: e["started_s"]):
        chains[e["conversation"]][e["arm"]].append(e)
    order = sorted(chains, key=lambda c: min(e["started_s"] for es in chains[c].values() for e in es))
    bound = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    retries = [] if retries is None else retries  # the arm of each request sent again after a transport error
    async with httpx.AsyncClient(timeout=600, limits=limits, transport=transport) as http:

        async def chain(arm: str, requests: list[dict[str, Any]], first: asyncio.Event) -> None:
            if arm == "control":  # its prompt holds the treatment's turn-1 answer: it cannot be sent before that
                await first.wait()
            for e in requests:
                body = dict(e["request"])
                if isinstance(body.get("cache_salt"), str):
                    body["cache_salt"] = f"{salt}-{body['cache_salt']}"
                sent = time.monotonic()
                for attempt in range(1, ATTEMPTS + 1):
                    try:
                        response = await http.post(f"{urls[arm]}/v1/chat/completions", json=body)
                        break
                    except TRANSIENT:  # e.g. a keep-alive connection the server closed: blackbox's client
                        if attempt == ATTEMPTS:  # retries these too (blackbox/client.py), so the replay does
                            raise
                        retries.append(arm)
                response.raise_for_status()
                timings.append(  # each request's latency, to set beside the run's (`latencies`)
                    {"arm": arm, "kind": e.get("kind"), "elapsed_s": time.monotonic() - sent}
                )
                if arm == "treatment":
                    first.set()

        async def conversation(c: int) -> None:
            first = asyncio.Event()
            if "treatment" not in chains[c]:
                first.set()
            async with bound:
                await asyncio.gather(*(chain(arm, rs, first) for arm, rs in chains[c].items()))

        started = time.monotonic()
        await asyncio.gather(*(conversation(c) for c in order))
        return time.monotonic() - started


def _blackbox(config: Any, folder: Path) -> tuple[Any, float, Sampler, float, float]:
    shutil.rmtree(folder, ignore_errors=True)
    store = RunStore(folder.parent, folder.name)  # its own cache_salt: every run starts as cold as the first
    try:
        return asyncio.run(measured_run(config, store))
    finally:
        store.close()


ROLES = ("treatment", "control", "reference")
CPU_TRIO = "cpu trio"


def loopback(url: str) -> bool:
    """Whether URL is http(s) on this machine (127.0.0.0/8, ::1 or localhost) with an explicit port."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    try:
        if parts.port is None:
            return False
    except ValueError:
        return False
    if parts.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(parts.hostname).is_loopback
    except ValueError:
        return False


def given_urls(args: argparse.Namespace) -> dict[str, str] | None:
    """The servers named on the command line (all three roles, loopback only), or None to start the CPU trio."""
    urls = {role: getattr(args, role) for role in ROLES if getattr(args, role)}
    if not urls:
        return None
    missing = [role for role in ROLES if role not in urls]
    if missing:
        raise ValueError(f"give all three of --treatment, --control, --reference (missing: {', '.join(missing)})")
    far = [url for url in urls.values() if not loopback(url)]
    if far:
        raise ValueError(f"only loopback servers (127.0.0.1, ::1, localhost, with a port): {', '.join(far)}")
    return {role: url.rstrip("/") for role, url in urls.items()}


def gpu_name() -> str | None:
    """The first GPU `nvidia-smi` names, or None where there is none."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    return names[0] if proc.returncode == 0 and names else None


def servers_label(label: str | None, given: bool, device: str | None) -> str:
    """What a row measured: the CPU trio this script starts, or the given servers (--label) on the device."""
    if not given:
        return CPU_TRIO
    name = label or "given servers"
    return f"{name} on {device}" if device else name


def one(case: Any, urls: Mapping[str, str], seed: int, args: argparse.Namespace) -> dict[str, Any]:
    config = faults.run_config(case, urls, seed, args, args.conversations)
    cold = args.keep_runs / f"overhead-s{seed}-n{args.conversations}-cold"
    _, cold_wall, _, _, _ = _blackbox(config, cold)
    # The cold run's requests replayed before the measured run as well as its own after it, so that servers
    # growing faster (or slower) over the sitting show as two replays that disagree, not as blackbox's cost.
    retries: list[str] = []
    before, _, _, _ = asyncio.run(
        sampled_replay(chats(cold), urls, config.concurrency, f"replay-{time.time_ns()}", [], retries)
    )
    folder = args.keep_runs / f"overhead-s{seed}-n{args.conversations}"
    result, wall, sampler, started, cpu = _blackbox(config, folder)
    exchanges = chats(folder)
    a, b = conversation_phase(exchanges, started)
    timings: list[dict[str, Any]] = []
    raw, replay_sampler, replay_started, replay_cpu = asyncio.run(
        sampled_replay(exchanges, urls, config.concurrency, f"replay-{time.time_ns()}", timings, retries)
    )
    idle = {role: sampler.idle(role, a, b) for role in sampler.urls}
    replay_idle = {
        role: replay_sampler.idle(role, replay_started, replay_started + raw) for role in replay_sampler.urls
    }
    return {
        "seed": seed,
        "conversations": args.conversations,
        "concurrency": config.concurrency,
        "requests": len(exchanges),
        "status": result.verdict.status.value,
        "blackbox_wall_s": round(wall, 2),
        "cold_blackbox_wall_s": round(cold_wall, 2),
        "conversation_phase_s": round(b - a, 2),
        "replay_wall_s": round(raw, 2),
        "replay_before_wall_s": round(before, 2),
        "ratio": round(wall / raw, 4),
        "phase_ratio": round((b - a) / raw, 4),
        "idle_fraction": {k: None if v is None else round(v, 4) for k, v in idle.items()},
        "replay_idle_fraction": {k: None if v is None else round(v, 4) for k, v in replay_idle.items()},
        "replay_sampled": True,
        "client_cpu_s": round(cpu, 1),
        "latencies": latencies(exchanges, timings),
        "replay_client_cpu_s": round(replay_cpu, 1),
        "replay_retries": len(retries),  # requests of both replays sent again after a transport error
        "samples": {role: len(s) for role, s in sampler.samples.items()},
    }


def servers_of(row: Mapping[str, Any]) -> str:
    """The row's servers; rows from before the key (2026-12-03 to 2026-12-06) all measured the CPU trio."""
    return str(row.get("servers") or CPU_TRIO)


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "# blackbox against a raw replay of its own requests (CPU trio and GPU servers)\n",
        "Rebuilt by `bench/overhead.py` from `overhead.jsonl` (each line has its command, date and commit). "
        "*Servers*: what was measured: the CPU trio the script starts on the build machine (two cores shared by "
        "the three servers and the client; rows without the key are these), or servers started beforehand and "
        "given by URL, named by `--label` and the GPU `nvidia-smi` names (16 cores there, the client's own). "
        "*blackbox*: the whole `blackbox run` (server checks, planning with /tokenize, conversations, /metrics "
        "settling, grading, report). *Phase*: first request sent to last answer back. *Replay*: the same chat "
        "requests, bodies as recorded and the cache salted anew, by a bare httpx loop at the same concurrency. "
        "*Idle*: fraction of 0.2 s samples in the conversation phase where a server had no request running or "
        "waiting. Targets (issue 24): ratio at most 1.03, idle at most 10%. *Cold*: a first run of the seed on "
        "the same servers (rows before it was added have none and were measured cold: their runs paid the "
        "servers' first kernel compiles, the replay did not). *Replay idle*: the same sampler during the replay "
        "(from 2026-12-05 on it polls both sides, so both pay its /metrics requests; before, the blackbox run "
        "alone). *Replay before*: the cold run's requests replayed between the cold and the measured run (from "
        "2026-12-06 on), against drift of the servers' speed over the sitting. *Client CPU*: seconds of CPU the "
        "blackbox process / the replay loop used (on the CPU trio the servers share the machine's two cores with "
        "it).\n",
        "| date | servers | seed | conversations | requests | verdict | cold | blackbox | phase | replay | ratio | "
        "phase / replay | idle (treatment, control, reference) | replay idle | replay before | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fractions(r: dict[str, Any], key: str) -> str:
        if key not in r:  # rows before 2026-12-05 sampled the blackbox run only
            return "-"
        return ", ".join("-" if r[key].get(k) is None else f"{r[key][k]:.0%}" for k in ROLES)

    for r in rows:
        idle = fractions(r, "idle_fraction")
        out.append(
            f"| {r['date']} | {servers_of(r)} | {r['seed']} | {r['conversations']} | {r['requests']} | "
            f"{r['status']} | "
            + (f"{r['cold_blackbox_wall_s']:.0f} s" if r.get("cold_blackbox_wall_s") else "-")
            + f" | {r['blackbox_wall_s']:.0f} s | {r['conversation_phase_s']:.0f} s | {r['replay_wall_s']:.0f} s | "
            f"{r['ratio']:.3f} | {r['phase_ratio']:.3f} | {idle} | {fractions(r, 'replay_idle_fraction')} | "
            + (f"{r['replay_before_wall_s']:.0f} s" if "replay_before_wall_s" in r else "-")
            + " | "
            + (f"{r['client_cpu_s']:.0f} s / {r['replay_client_cpu_s']:.0f} s" if "client_cpu_s" in r else "-")
            + " |"
        )
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[servers_of(r)].append(r)
    if groups:
        out.append("")
    for servers, group in groups.items():  # a mean across CPU and GPU rows would mean nothing
        out.append(
            f"{servers}: mean ratio {statistics.mean(r['ratio'] for r in group):.3f}, "
            f"mean phase / replay {statistics.mean(r['phase_ratio'] for r in group):.3f} "
            f"over {len(group)} run{'s' * (len(group) != 1)}."
        )
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed-start", type=int, default=500)
    parser.add_argument("--race-rounds", type=int, default=faults.RaceSettings.rounds_per_size)
    parser.add_argument("--reference-ratio", type=int, default=faults.RunConfig.reference_ratio)
    parser.add_argument("--base-port", type=int, default=8300)
    parser.add_argument("--cache-dir", type=Path, default=Path(".blackbox-cache"))
    parser.add_argument("--keep-runs", type=Path, default=Path("runs/bench-overhead"))
    for role in ROLES:
        parser.add_argument(f"--{role}", metavar="URL", help="a running server (all three or none; loopback only)")
    parser.add_argument("--label", help="what the given servers are, e.g. gpu-tiny (the GPU's name is added)")
    parser.add_argument("--commit", help="the commit measured, where the copy has no git (default: git describe)")
    parser.add_argument("--rebuild-table", action="store_true", help="only rebuild overhead.md from the jsonl")
    args = parser.parse_args(argv)
    try:
        args.urls = given_urls(args)
    except ValueError as e:
        parser.error(str(e))
    if args.label and args.urls is None:
        parser.error("--label names given servers: use it with --treatment, --control and --reference")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.rebuild_table:
        measure(args)
    rows = faults.load_runs(RUNS_FILE)
    TABLE_FILE.write_text(table(rows))
    print(f"{TABLE_FILE} rebuilt from {len(rows)} runs")
    return 0


def measure(args: argparse.Namespace) -> None:
    device = gpu_name() if args.urls else None
    stamp = {
        "command": shlex.join(["python", "bench/overhead.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": args.commit or faults._commit(),
        "servers": servers_label(args.label, args.urls is not None, device),
    }
    args.keep_runs.mkdir(parents=True, exist_ok=True)
    case = faults.select("clean")[0]
    with contextlib.ExitStack() as stack:
        urls = args.urls
        if urls is None:
            fleet = faults.fleet_for(case, args, args.keep_runs / "servers")
            stack.enter_context(fleet)
            stack.enter_context(fleet.handle_signals())
            fleet.start()
            urls = fleet.urls
        for seed in range(args.seed_start, args.seed_start + args.seeds):
            row = {**one(case, urls, seed, args), **stamp}
            faults.append_run(RUNS_FILE, row)
            print(
                f"seed {seed} ({row['servers']}): blackbox {row['blackbox_wall_s']} s (phase "
                f"{row['conversation_phase_s']} s), replay {row['replay_before_wall_s']} s before, "
                f"{row['replay_wall_s']} s after, ratio {row['ratio']}, idle {row['idle_fraction']}",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
