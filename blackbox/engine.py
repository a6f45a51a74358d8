"""The one engine behind the CLI and the pytest plugin: drive the conversations, gate, grade, store."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from blackbox import comparability, errors, gates, geometry, guard, metrics, race
from blackbox.client import Endpoint, gather_bounded
from blackbox.config import RunConfig
from blackbox.graders import Grades, grade
from blackbox.history import Arm, Exchange, History, Kind, Plan
from blackbox.metrics import MetricsDelta, MetricsSnapshot
from blackbox.store import RunStore, load_history, load_preflight
from blackbox.verdict import Finding, Status, Verdict, merge
from blackbox.workload import plan_conversation, turn1_body, turn2_body, turn2_messages

__all__ = ["RunResult", "judge", "run"]

Progress = Callable[[int, int, str], None]
_SETTLE_KEYS = (metrics.CACHE_HITS, metrics.CACHE_QUERIES, metrics.DRAFTS, metrics.ACCEPTED)


@dataclass(frozen=True)
class RunResult:
    verdict: Verdict
    history: History | None
    grades: Grades | None
    store_path: Path
    elapsed_s: float
    geometry: geometry.Geometry | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


async def run(config: RunConfig, store: RunStore, progress: Progress | None = None) -> RunResult:
    """Never raises (bar SystemExit): whatever ends the run (a verdict, the --deadline, SIGINT/SIGTERM as a
    cancellation, an unexpected exception) ends it with verdict.json written, when the disk allows."""
    started = time.monotonic()
    tracked = guard.Progress(progress or _quiet)
    try:
        return await guard.within(_run(config, store, tracked), config.deadline_s)
    except BaseException as exc:
        error = guard.as_error(exc, config, tracked, store.recorded)
        if error is None:
            raise
        guard.keep_traceback(store.path, exc, error, store.redact)
        verdict = merge([Finding.from_error("run", error)])
        try:
            return _finish(store, verdict, None, None, started, None)
        except errors.StorageError:
            return RunResult(verdict, None, None, store.path, time.monotonic() - started)


async def _run(config: RunConfig, store: RunStore, progress: Progress) -> RunResult:
    """An endpoint or geometry failure becomes the verdict, and the store keeps what was recorded up to it."""
    started = time.monotonic()
    store.write_json("config.json", config.to_json())  # first, so even a run cut short can be read and replayed
    urls = {Arm.TREATMENT: config.treatment}
    if config.control:
        urls[Arm.CONTROL] = config.control
    if config.reference:
        urls[Arm.REFERENCE] = config.reference
    watch = guard.watch(config, store)
    key, key_source = config.api_key, guard.key_source(config)
    endpoints = {
        arm: Endpoint(
            arm,
            url,
            api_key=key,
            model=config.model,
            timeout_s=config.timeout_s,
            watch=watch,
            key_source=key_source,
            metrics_urls=config.treatment_metrics if arm == Arm.TREATMENT else (),
        )
        for arm, url in urls.items()
    }
    history: History | None = None
    geo: geometry.Geometry | None = None
    try:
        async with watch.running(endpoints.values()):
            history, geo, preflight = await _drive(config, endpoints, store, progress)
    except errors.BlackboxError as exc:
        verdict = merge([Finding.from_error("setup", exc)])
        return _finish(store, verdict, None, None, started, geo)
    finally:
        await asyncio.gather(*(e.aclose() for e in endpoints.values()))
    if history is None:  # the servers are not comparable: nothing was sent
        return _finish(store, merge(preflight), None, None, started, geo)
    verdict, grades = judge(history, config, preflight)
    _write_replays(store, urls, history, verdict, config.api_key_env, config.api_key_file)
    return _finish(store, verdict, history, grades, started, geo)


def judge(history: History, config: RunConfig, preflight: Sequence[Finding] = ()) -> tuple[Verdict, Grades]:
    """Gates, then graders, over a history: the whole verdict, from data alone. No grader runs when a gate
    failed (see `verdict.merge`)."""
    premises = [*preflight, *gates.all_gates(history, config.grading, config.probes)]
    if any(f.status is not Status.PASS for f in premises):
        grades = Grades((), (), (("all graders", "not run: a gate failed"),))
    else:
        grades = grade(history, config.grading, config.probes)
    return merge([*premises, *grades.findings]), grades


@dataclass(frozen=True)
class Rejudged:
    verdict: Verdict
    grades: Grades
    history: History
    config: RunConfig


def rejudge(run_dir: Path) -> Rejudged:
    """A stored run judged again by this code, with the settings and the stored pre-run findings it ran with."""
    data, history = load_history(run_dir)
    config = RunConfig.from_json(data)
    verdict, grades = judge(history, config, load_preflight(run_dir))
    return Rejudged(verdict, grades, history, config)


def _quiet(done: int, total: int, note: str) -> None:
    pass


def _planned(config: RunConfig, endpoints: Mapping[str, Endpoint]) -> int:
    """Conversations the run drives, the reference's yardstick extras included (none without multiturn)."""
    if "multiturn" not in config.probes:
        return 0
    return config.conversations * (config.reference_ratio if Arm.REFERENCE in endpoints else 1)


async def _drive(
    config: RunConfig, endpoints: Mapping[str, Endpoint], store: RunStore, progress: Progress
) -> tuple[History | None, geometry.Geometry, list[Finding]]:
    treatment = endpoints[Arm.TREATMENT]
    total = _planned(config, endpoints)  # the one denominator of every progress line of the run
    progress(0, total, "checking servers")
    for endpoint in endpoints.values():
        await endpoint.ready()
    before = {arm: await e.metrics() for arm, e in endpoints.items()}
    for arm, snap in before.items():
        store.write_text(f"metrics/{arm}-before.prom", snap.text)
    infos = {arm: await e.info(before[arm]) for arm, e in endpoints.items()}
    store.write_json("servers.json", {arm: info.to_json() for arm, info in infos.items()})
    salt = f"blackbox-{store.path.name}"
    facts = {arm: await comparability.gather(e, before[arm], salt, store.record) for arm, e in endpoints.items()}
    preflight = comparability.check(facts, config.grading.hard_margin)
    store.write_json("preflight.json", [f.to_json() for f in preflight])
    known = [f.max_model_len for f in facts.values() if f.max_model_len is not None]
    geo = geometry.discover(before[Arm.TREATMENT], min(known) if known else None, config.block_size)
    store.write_json("geometry.json", geo.__dict__)
    if any(f.status is not Status.PASS for f in preflight):
        return None, geo, preflight

    def record(e: Exchange) -> Exchange:
        store.record(e)
        # The raw body (logprobs as nested JSON) is on disk now; graders read the parsed tokens only.
        return dataclasses.replace(e, response=None)

    plans: list[Plan] = []
    yardstick: list[Plan] = []
    exchanges: list[Exchange] = []
    if "multiturn" in config.probes:
        plans, found = await _multiturn(config, endpoints, geo, salt, record, progress)
        plans, yardstick = plans[: config.conversations], plans[config.conversations :]
        exchanges.extend(found)
        store.write_json("plans.json", [p.__dict__ for p in plans])
        if yardstick:
            store.write_json("yardstick-plans.json", [p.__dict__ for p in yardstick])
    rounds: list[race.RaceRound] = []
    race_window: MetricsDelta | None = None
    if "cold-race" in config.probes:
        progress(len(plans) + len(yardstick), total, "cold race")
        rounds, found, race_window = await _cold_race(config, treatment, geo, salt, record, store)
        exchanges.extend(found)
    progress(len(plans) + len(yardstick), total, "waiting for counters to settle")
    after = {arm: await _settle(e, config.settle_s) for arm, e in endpoints.items()}
    for arm, snap in after.items():
        store.write_text(f"metrics/{arm}-after.prom", snap.text)
    # Every scrape in between too (periodic ones included), so a restart that the counters outgrew is caught.
    deltas = {arm: MetricsDelta(before[arm], after[arm], tuple(endpoints[arm].scrapes)) for arm in endpoints}
    history = History(
        geo.block_size,
        tuple(plans),
        tuple(exchanges),
        deltas,
        tuple(rounds),
        config.max_num_batched_tokens,
        race_window,
        infos[Arm.TREATMENT],
        tuple(yardstick),
    )
    return history, geo, preflight


async def _multiturn(
    config: RunConfig,
    endpoints: Mapping[str, Endpoint],
    geo: geometry.Geometry,
    salt: str,
    record: Callable[[Exchange], Exchange],
    progress: Progress,
) -> tuple[list[Plan], list[Exchange]]:
    """Every arm runs conversations 0..n-1; the reference alone runs the yardstick's n..ratio*n-1 as well."""
    total = _planned(config, endpoints)
    progress(0, total, f"sizing prompts (block {geo.block_size} tokens)")
    count = endpoints[Arm.TREATMENT].count_tokens
    plans = await gather_bounded(
        config.concurrency * 2,
        *(
            plan_conversation(i, config.seed, config.shape, geo.block_size, geo.max_model_len, count)
            for i in range(total)
        ),
    )
    done = 0

    async def one(plan: Plan) -> list[Exchange]:
        nonlocal done
        out = await _conversation(config, endpoints, plan, salt, record)
        done += 1
        progress(done, total, f"conversation {plan.index} done")
        return out

    # Interleaved (0, n, 2n, 1, n+1, ...) so the treatment is not left idle while the reference runs its extras.
    order = sorted(plans, key=lambda p: (p.index % config.conversations, p.index))
    results = await gather_bounded(config.concurrency, *(one(p) for p in order))
    return list(plans), [e for r in results for e in r]


async def _cold_race(
    config: RunConfig,
    treatment: Endpoint,
    geo: geometry.Geometry,
    salt: str,
    record: Callable[[Exchange], Exchange],
    store: RunStore,
) -> tuple[list[race.RaceRound], list[Exchange], MetricsDelta]:
    """The race rounds between two settled snapshots (the window proves fragmentation), then the liveness pair."""
    found: list[Exchange] = []

    def keep(e: Exchange) -> Exchange:
        found.append(record(e))
        return found[-1]

    before = await _settle(treatment, config.settle_s)
    rounds = await race.drive(treatment, config.race, config.seed, geo.block_size, geo.max_model_len, salt, keep)
    window = MetricsDelta(before, await _settle(treatment, config.settle_s))
    store.write_text("metrics/race-window/before.prom", window.before.text)
    store.write_text("metrics/race-window/after.prom", window.after.text)
    await race.send_liveness(treatment, config.seed, geo.block_size, geo.max_model_len, salt, keep)
    store.write_json("race.json", {"budget": config.max_num_batched_tokens, "rounds": [r.__dict__ for r in rounds]})
    return rounds, found, window


async def _conversation(
    config: RunConfig,
    endpoints: Mapping[str, Endpoint],
    plan: Plan,
    salt: str,
    record: Callable[[Exchange], Exchange],
) -> list[Exchange]:
    shape, conv = config.shape, plan.index

    async def ask(arm: str, kind: str, body: dict[str, object]) -> Exchange:
        return record(await endpoints[arm].chat(body, conversation=conv, kind=kind))

    def fresh(kind: str) -> str:
        return f"{salt}-{conv}-{kind}-fresh"

    async def resumed(arm: str) -> list[Exchange]:
        """Turn 1 on `arm`, then turn 2 on its own answer: hit first, then the same prompt with no reuse."""
        t1 = await ask(arm, Kind.TURN1, {**turn1_body(plan, shape), "cache_salt": salt})
        if not t1.ok:
            return [t1]
        m2 = turn2_messages(plan, t1.text)
        out = [t1, await ask(arm, Kind.TURN2, turn2_body(m2, shape, salt=salt))]
        out.append(await ask(arm, Kind.TURN2_FRESH, turn2_body(m2, shape, salt=fresh(Kind.TURN2))))
        control = (
            asyncio.create_task(ask(Arm.CONTROL, Kind.TURN2, turn2_body(m2, shape, salt=salt)))
            if arm == Arm.TREATMENT and Arm.CONTROL in endpoints
            else None
        )
        # The probe's hit ends in the prefill-written region; on the reference it measures whether this engine
        # is bit-exact there, so exactness is demanded only where it was measured.
        out.append(await ask(arm, Kind.PROBE, turn2_body(plan.probe_messages, shape, salt=salt, probe=True)))
        out.append(
            await ask(arm, Kind.PROBE_FRESH, turn2_body(plan.probe_messages, shape, salt=fresh(Kind.PROBE), probe=True))
        )
        if control is not None:
            out.append(await control)
        return out

    if conv >= config.conversations:  # a yardstick conversation: the reference's alone
        return await resumed(Arm.REFERENCE)
    chains = [resumed(Arm.TREATMENT)]
    if Arm.REFERENCE in endpoints:
        chains.append(resumed(Arm.REFERENCE))
    return [e for chain in await asyncio.gather(*chains) for e in chain]


async def _settle(endpoint: Endpoint, limit_s: float) -> MetricsSnapshot:
    """vLLM updates counters after responding: poll until the counters we read stop moving."""
    deadline = time.monotonic() + limit_s
    last = await endpoint.metrics()
    stable = 0
    while time.monotonic() < deadline and stable < 2:
        await asyncio.sleep(0.5)
        current = await endpoint.metrics()
        same = all(current.value(k) == last.value(k) for k in _SETTLE_KEYS)
        stable = stable + 1 if same else 0
        last = current
    return last


def _write_replays(
    store: RunStore,
    urls: Mapping[str, str],
    history: History,
    verdict: Verdict,
    key_env: str,
    key_file: str | None = None,
) -> None:
    flagged: set[int] = set()
    for f in verdict.findings:
        if f.status is Status.PASS:
            continue  # a PASS lists nothing to replay; the first conversation is kept as an example below
        flagged.update(int(m["unit"]) for m in f.figures.get("mismatches", ()) or ())
        flagged.update(int(c) for c in f.figures.get("forward_flips", ()) or ())
    flagged = flagged or {p.index for p in history.plans[:1]} or {r.index for r in history.races[:1]}
    store.write_replays(urls, (e for e in history.exchanges if e.conversation in flagged), key_env, key_file)


def _finish(
    store: RunStore,
    verdict: Verdict,
    history: History | None,
    grades: Grades | None,
    started: float,
    geo: geometry.Geometry | None,
) -> RunResult:
    elapsed = time.monotonic() - started
    payload = {**verdict.to_json(), "elapsed_s": round(elapsed, 2)}
    if grades is not None:
        payload["graders_used"] = list(grades.used)
        payload["graders_not_used"] = [{"grader": g, "why": w} for g, w in grades.not_used]
    store.write_json("verdict.json", payload)
    return RunResult(verdict, history, grades, store.path, elapsed, geo)
