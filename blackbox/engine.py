"""The one engine behind the CLI and the pytest plugin: drive each probe named, gate, grade, store.

The engine knows probes only through `blackbox.probes` (the registry and the `Probe` interface)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, cast

from blackbox import comparability, errors, gates, geometry, guard, probes, sequential, yardstick
from blackbox.client import Endpoint
from blackbox.config import RunConfig
from blackbox.graders import Grades, grade
from blackbox.history import Arm, Exchange, History
from blackbox.metrics import MetricsDelta, MetricsSnapshot
from blackbox.probes.base import DriveContext, Driven, Progress, settle
from blackbox.server_info import ServerInfo
from blackbox.store import RunStore, load_history, load_preflight, load_servers
from blackbox.verdict import Finding, Status, Verdict, merge

T = TypeVar("T")

__all__ = ["RunResult", "judge", "run"]


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
    failed (see `verdict.merge`). A run with --detect is judged look by look (`blackbox.sequential`)."""
    schedule = config.schedule
    if schedule is None or config.detect is None:
        return _judge_at(history, config, preflight, config.grading.alpha)
    verdict, grades = sequential.judge(
        history, schedule, config.detect, lambda h, alpha: _judge_at(h, config, preflight, alpha)
    )
    return verdict, grades


def _judge_at(
    history: History, config: RunConfig, preflight: Sequence[Finding], alpha: float
) -> tuple[Verdict, Grades]:
    premises = [*preflight, *gates.all_gates(history, config.grading, config.probes)]
    if any(f.status is not Status.PASS for f in premises):
        grades = Grades((), (), (("all graders", "not run: a gate failed"),))
    else:
        assumed = next((f.figures.get("assumed_alike") or () for f in preflight if f.check == "yardstick"), ())
        grading = dataclasses.replace(config.grading, alpha=alpha, yardstick_assumed=tuple(assumed))
        grades = grade(history, grading, config.probes)
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
    verdict, grades = judge(history, config, _with_yardstick(load_preflight(run_dir), run_dir, config.probes))
    return Rejudged(verdict, grades, history, config)


def _with_yardstick(preflight: list[Finding], run_dir: Path, probes: Sequence[str] = ("multiturn",)) -> list[Finding]:
    """The `yardstick` gate decided again from the stored servers.json, so a run from before the gate (or judged
    by an older list of settings) is judged by this code's list."""
    infos = load_servers(run_dir)
    if infos is None:
        return preflight
    return [*(f for f in preflight if f.check != "yardstick"), yardstick.check(infos, probes)]


def _quiet(done: int, total: int, note: str) -> None:
    pass


def _sent(by_probe: Mapping[str, Driven]) -> int:
    """Conversations of the multiturn probe driven so far (its plans and the reference's yardstick extras)."""
    done = by_probe.get("multiturn")
    return len(done.plans) + len(done.yardstick) if done else 0


def _phase(progress: Progress, name: str, total: int, by_probe: Mapping[str, Driven]) -> Progress:
    """A probe other than multiturn reports on the run's line without changing its denominator."""

    def report(done: int, of: int, note: str) -> None:
        progress(_sent(by_probe), total, f"{name}: {note}" + (f" ({done}/{of})" if of else ""))

    return report


def _planned(config: RunConfig, endpoints: Mapping[str, Endpoint]) -> int:
    """Conversations the run drives, the reference's yardstick extras included (none without multiturn); a run
    with --detect counts its whole budget, which it may not need."""
    if "multiturn" not in config.probes:
        return 0
    n = config.conversations if config.schedule is None else config.max_conversations
    return n * (config.reference_ratio if Arm.REFERENCE in endpoints else 1)


async def _drive(
    config: RunConfig, endpoints: Mapping[str, Endpoint], store: RunStore, progress: Progress
) -> tuple[History | None, geometry.Geometry, list[Finding]]:
    total = _planned(config, endpoints)  # the one denominator of every progress line of the run
    progress(0, total, "checking servers")
    arms = list(endpoints)

    async def each(call: Callable[[str, Endpoint], Awaitable[T]]) -> dict[str, T]:
        """`call` on every arm at once (separate servers, each of which has answered), keyed by arm. A failure is
        raised once every call has ended, the first arm's in order: which server an error names must not depend
        on which answered first, and no request is left in flight."""
        done = await asyncio.gather(*(call(a, endpoints[a]) for a in arms), return_exceptions=True)
        for result in done:
            if isinstance(result, BaseException):
                raise result
        return {a: cast(T, r) for a, r in zip(arms, done, strict=True)}

    # One at a time, in order: the first server that is down or misconfigured is named, and none after it is asked.
    for endpoint in endpoints.values():
        await endpoint.ready()
    before = await each(lambda _a, e: e.metrics())
    for arm, snap in before.items():
        store.write_text(f"metrics/{arm}-before.prom", snap.text)
    infos = await each(lambda a, e: e.info(before[a]))
    store.write_json("servers.json", {arm: info.to_json() for arm, info in infos.items()})
    salt = f"blackbox-{store.path.name}"
    facts = await each(lambda a, e: comparability.gather(e, before[a], salt, store.record))
    preflight = comparability.check(facts, config.grading.hard_margin, infos, config.probes)
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

    ctx = DriveContext(config, endpoints, geo, salt, record, progress, store)
    by_probe: dict[str, Driven] = {}
    chosen = probes.selected(config.probes)
    schedule = config.schedule
    for probe in chosen:
        if schedule is not None and probe.name == "multiturn":
            continue  # driven in rounds below, after the probes that run once
        # The multiturn probe counts the run's conversations; the others are phases of the same line.
        phase = progress if probe.name == "multiturn" else _phase(progress, probe.name, total, by_probe)
        by_probe[probe.name] = done = await probe.drive(dataclasses.replace(ctx, progress=phase))
        if done.data is not None:
            store.write_json(f"probes/{probe.name}.json", done.data)
    if schedule is None:
        progress(_sent(by_probe), total, "waiting for counters to settle")
        return await _history(config, endpoints, store, geo, infos, before, by_probe), geo, preflight
    return await _rounds(ctx, schedule, by_probe, before, infos, preflight, total), geo, preflight


async def _rounds(
    ctx: DriveContext,
    schedule: sequential.Schedule,
    by_probe: dict[str, Driven],
    before: Mapping[str, MetricsSnapshot],
    infos: Mapping[str, ServerInfo],
    preflight: Sequence[Finding],
    total: int,
) -> History:
    """The multiturn probe a round at a time, judged after each round at that look's level, until a look stops
    the run, the schedule ends, or the next round would not finish before --deadline (blackbox.sequential)."""
    config, store, progress = ctx.config, ctx.store, ctx.progress
    detect = config.detect
    assert detect is not None
    deadline = None if config.deadline_s is None else time.monotonic() + config.deadline_s
    sent, rounds = 0, []
    history: History | None = None
    for k, n in enumerate(schedule.looks, 1):
        began = time.monotonic()

        def line(done: int, of: int, note: str, so_far: int = _sent(by_probe), k: int = k) -> None:
            progress(so_far + done, total, f"look {k}/{len(schedule.looks)}: {note}")

        rounds.append(await probes.PROBES["multiturn"].drive(dataclasses.replace(ctx, units=(sent, n), progress=line)))
        sent = n
        by_probe["multiturn"] = merged = Driven(
            exchanges=tuple(e for r in rounds for e in r.exchanges),
            plans=tuple(p for r in rounds for p in r.plans),
            yardstick=tuple(p for r in rounds for p in r.yardstick),
        )
        store.write_plans(merged.plans, merged.yardstick)
        history = await _history(config, ctx.endpoints, store, ctx.geometry, infos, before, by_probe)
        verdict, _ = _judge_at(history, config, preflight, schedule.level(k))
        q = sequential.coverage(verdict)
        progress(
            _sent(by_probe),
            total,
            f"look {k}: {verdict.status.value}" + (f", covers {q:.0%} of hits" if q is not None else ""),
        )
        if sequential.stops(verdict, detect):
            break
        elapsed = time.monotonic() - began
        if deadline is not None and time.monotonic() + 1.5 * elapsed + config.settle_s > deadline:
            progress(_sent(by_probe), total, "the next round would end past --deadline: stopping")
            break
    assert history is not None
    return history


async def _history(
    config: RunConfig,
    endpoints: Mapping[str, Endpoint],
    store: RunStore,
    geo: geometry.Geometry,
    infos: Mapping[str, ServerInfo],
    before: Mapping[str, MetricsSnapshot],
    by_probe: Mapping[str, Driven],
) -> History:
    """The run's history from what the probes drove, with every server's counters settled since `before`."""
    driven = list(by_probe.values())
    settled = await asyncio.gather(*(settle(e, config.settle_s) for e in endpoints.values()))
    after = dict(zip(endpoints, settled, strict=True))
    for arm, snap in after.items():
        store.write_text(f"metrics/{arm}-after.prom", snap.text)
    # Every scrape in between too (periodic ones included), so a restart that the counters outgrew is caught.
    deltas = {arm: MetricsDelta(before[arm], after[arm], tuple(endpoints[arm].scrapes)) for arm in endpoints}
    return History(
        geo.block_size,
        tuple(p for d in driven for p in d.plans),
        tuple(e for d in driven for e in d.exchanges),
        deltas,
        tuple(r for d in driven for r in d.races),
        config.max_num_batched_tokens,
        next((d.race_window for d in driven if d.race_window is not None), None),
        infos[Arm.TREATMENT],
        tuple(p for d in driven for p in d.yardstick),
        {name: d.data for name, d in by_probe.items() if d.data is not None},
    )


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
    flagged = (
        flagged
        or {p.index for p in history.plans[:1]}
        or {r.index for r in history.races[:1]}
        or {e.conversation for e in history.exchanges[:1]}  # a probe with neither: its first request's unit
    )
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
