"""report.html: one static, self-contained page per run folder (no server, no network), and a page comparing runs.

Everything is read from the folder alone (`run_folder.read`), so `blackbox report` draws stored runs as well as
the one just finished. The banner is verdict.json's verdict; a figure whose data the folder lacks is left out
with a one-line note. The figures are SVG from matplotlib, embedded as data URIs (so their ids cannot collide).
A report that cannot be written never changes a run's verdict or exit code (`write_quietly`).
"""

from __future__ import annotations

import base64
import datetime
import html
import math
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from blackbox import __version__, graders, guard
from blackbox.evidence import RANKS, Sample
from blackbox.history import Arm, Exchange, Kind, TokenLogprob
from blackbox.run_folder import RunFolder, read
from blackbox.secrets import Redactor
from blackbox.store import write_traceback
from blackbox.verdict import Verdict
from blackbox.watch import stderr_line

__all__ = ["REPORT", "compare", "render", "write", "write_quietly"]

REPORT = "report.html"
_TWIN = {Kind.TURN2: Kind.TURN2_FRESH, Kind.PROBE: Kind.PROBE_FRESH}
_DIFF_TOKENS = 24  # answer positions shown side by side
_DETAILED = 12  # flagged conversations drawn in full; the rest are listed


def write(run_dir: Path, *, regraded: Verdict | None = None, redact: Redactor | None = None) -> Path:
    target = run_dir / REPORT
    target.write_text((redact or Redactor())(render(run_dir, regraded=regraded)), encoding="utf-8")
    return target


def write_quietly(
    run_dir: Path,
    redact: Redactor | None = None,
    log: Callable[[str], None] = stderr_line,
    *,
    regraded: Verdict | None = None,
) -> Path | None:
    """`write`, for the end of a run or a re-grade: a failure is one line on stderr and a traceback in the
    folder, never a change of verdict or exit code."""
    try:
        return write(run_dir, regraded=regraded, redact=redact)
    except Exception as exc:
        text = "".join(traceback.format_exception(exc))
        kept = write_traceback(run_dir, text, redact or Redactor(), "traceback-report.txt")
        log(f"blackbox: {REPORT} not written ({type(exc).__name__}); the verdict stands; traceback: {kept}")
        return None


def render(run_dir: Path, *, regraded: Verdict | None = None) -> str:
    folder = read(run_dir)
    sections = [
        _banner(folder, regraded),
        _settings(folder),
        _evidence(folder),
        _figures(folder),
        _flagged(folder),
        _files(folder),
    ]
    return _page(f"blackbox {_status(folder)} · {run_dir.name}", "".join(sections))


# --- the banner and the tables ------------------------------------------------------------------------------


def _status(folder: RunFolder) -> str:
    return str((folder.verdict or {}).get("status") or "NO VERDICT")


def _banner(folder: RunFolder, regraded: Verdict | None) -> str:
    v = folder.verdict or {}
    status = _status(folder)
    if folder.verdict is None:
        stopped = guard.unfinished(folder.path)
        reason, hint, cls, code = (stopped.message if stopped else "no verdict.json"), "", "", ""
    else:
        reason, hint = str(v.get("reason", "")), str(v.get("hint") or "")
        cls, code = str(v.get("error_class") or ""), str(v.get("exit_code", ""))
    meaning = {
        "PASS": "the trigger was exercised and no grader found the treatment worse than its yardstick",
        "FAIL": "the treatment's cache hits answered worse than a correct engine does: corruption",
        "UNKNOWN": "nothing was concluded; this is never a PASS",
        "ERROR": "the run could not test the server (bad input, a server or network failure, or a bug)",
    }.get(status, "the run did not finish")
    again = ""
    if regraded is not None:
        same = regraded.status.value == status and (regraded.error_class or "") == cls
        again = (
            f'<p class="regraded">Re-judged by <code>blackbox grade</code> with blackbox {__version__}: '
            f"<b>{_e(regraded.status.value)}</b>{_e(f' ({regraded.error_class})' if regraded.error_class else '')}"
            f", exit code {regraded.exit_code}"
            + ("; the same verdict." if same else f": {_e(regraded.reason)}")
            + "</p>"
        )
    elapsed = v.get("elapsed_s")
    return (
        f'<section class="banner {_e(status.replace(" ", "-"))}">'
        f'<div class="status"><span id="verdict">{_e(status)}</span>'
        + (f' <span class="class" id="error-class">{_e(cls)}</span>' if cls else "")
        + (f' <span class="exit">exit code <b id="exit-code">{_e(code)}</b></span>' if code else "")
        + f'</div><p class="meaning">{_e(meaning)}</p><p class="reason" id="reason">{_e(reason)}</p>'
        + (f'<p class="hint">Next: {_e(hint)}</p>' if hint else "")
        + again
        + f'<p class="where">Run folder <code>{_e(str(folder.path))}</code>'
        + (f" · {elapsed:.0f} s" if isinstance(elapsed, (int, float)) else "")
        + "</p></section>"
    )


def _settings(folder: RunFolder) -> str:
    rows: list[tuple[str, str]] = []
    if folder.command:
        rows.append(("command", f"<code>{_e(folder.command)}</code>"))
    c = folder.config
    if c is not None:
        for arm in (Arm.TREATMENT, Arm.CONTROL, Arm.REFERENCE):
            url = getattr(c, arm)
            info = folder.servers.get(arm) or {}
            version = f" (vLLM {info['version']})" if info.get("version") else ""
            rows.append((arm, _e(url + version) if url else "none"))
        model = c.model or _served_model(folder)
        rows.append(("model", _e(model or "the first each server lists")))
        rows.append(
            (
                "workload",
                _e(
                    (
                        f"{c.conversations} conversations"
                        if c.detect is None
                        else f"--detect {c.detect:g}: rounds of {c.round_conversations} up to {c.max_conversations} "
                        f"conversations, sent {len(folder.history.plans) if folder.history else '?'}"
                    )
                    + f" (reference x{c.reference_ratio}), seed {c.seed}, "
                    f"probes {', '.join(c.probes)}, alpha {c.grading.alpha:g}"
                ),
            )
        )
    if folder.history is not None:
        rows.append(("block size", f"{folder.history.block_size} tokens"))
    used = (folder.verdict or {}).get("graders_used")
    if used is not None:
        rows.append(("graders used", _e(", ".join(used) or "none")))
    for g in (folder.verdict or {}).get("graders_not_used") or []:
        rows.append(("not used", _e(f"{g.get('grader')}: {g.get('why')}")))
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<section><h2>Run</h2><table class="kv">{body}</table></section>' if rows else ""


def _served_model(folder: RunFolder) -> str | None:
    for e in folder.history.exchanges if folder.history else ():
        if e.request.get("model"):
            return str(e.request["model"])
    return None


def power_statement(finding: Mapping[str, Any]) -> str:
    """What the finding could have seen, from its figures (a PASS's reason says it too; a FAIL's does not)."""
    fig = finding.get("figures") or {}
    if fig.get("conversations_needed"):
        return f"too few samples: run about {fig['conversations_needed']} conversations"
    q = fig.get("detectable_fraction")
    if q is None:
        return "n/a" if "detection_power" in fig else ""
    power = fig.get("detection_power")
    if "detectable_deviation" in fig:
        size = fig["detectable_deviation"]
        size_text = f"beyond {_nat(size)}" if size else "any difference from recomputation"
        text = f"{size_text} in ≥ {q:.0%} of {fig.get('n_subject')} hits"
        deep = fig.get("detectable_fraction_deep")
        if deep:
            text += f", or beyond {_nat(fig.get('detectable_deviation_deep'))} in ≥ {deep:.0%}"
        text += f", with probability {power}"
        asks = [(f, fig.get(f"conversations_for_{f}pct")) for f in (20, 10)]
        text += "".join(f"; {f}% of hits needs about {n} conversations" for f, n in asks if n and q * 100 > f)
        return text
    return f"lost recall in ≥ {q:.0%} of {fig.get('n')} hits, with probability {power}"


def _p_values(finding: Mapping[str, Any]) -> str:
    fig = finding.get("figures") or {}
    ps = fig.get("p_values") or ({"sign test": fig["p_value"]} if "p_value" in fig else {})
    level = fig.get("alpha_per_test") or fig.get("alpha")
    text = ", ".join(f"{k} {_num(p)}" for k, p in ps.items())
    return text + (f" (level {_num(level)})" if text and level else "")


def _evidence(folder: RunFolder) -> str:
    if not folder.findings:
        return ""
    rows = []
    for f in folder.findings:
        status = str(f.get("status"))
        hint = f.get("hint") if status != "PASS" else ""
        rows.append(
            f'<tr class="{_e(status)}"><td>{_e(f.get("check"))}</td><td>{_e(f.get("stage", "gate"))}</td>'
            f'<td class="st">{_e(status)}{_e(" · " + f["error_class"] if f.get("error_class") else "")}</td>'
            f"<td>{_e(f.get('reason'))}" + (f'<div class="hint">→ {_e(hint)}</div>' if hint else "") + "</td>"
            f"<td>{_e(power_statement(f))}</td><td>{_e(_p_values(f))}</td></tr>"
        )
    head = "<tr><th>check</th><th>stage</th><th>status</th><th>finding</th><th>could have seen</th><th>p</th></tr>"
    return (
        "<section><h2>Evidence</h2><p>Gates are the run's premises (a failed gate means no grader counts); graders "
        f'judge the outputs.</p><table class="evidence">{head}{"".join(rows)}</table></section>'
    )


# --- figures ----------------------------------------------------------------------------------------------


def _figures(folder: RunFolder) -> str:
    parts: list[str] = []
    notes: list[str] = []
    try:
        from blackbox import plots
    except ImportError as exc:
        return f'<section><h2>Figures</h2><p class="note">no figures: matplotlib is not installed ({_e(exc)})</p>'
    for name, draw in (
        ("decode-region deviations", lambda: _deviation_plot(folder, graders.LOGPROB, plots)),
        ("prefill-region deviations", lambda: _deviation_plot(folder, graders.EXACTNESS, plots)),
        ("where turn-2 hits resumed", lambda: _resume_plot(folder, plots)),
        ("drafter acceptance", lambda: _acceptance_plot(folder, plots)),
        ("hit rate by offset", lambda: _offset_plot(folder, plots)),
        ("request timeline", lambda: _timeline_plot(folder, plots)),
    ):
        try:
            svg, caption = draw()
        except Exception as exc:  # a figure is a view: a bug drawing it must not cost the rest of the report
            svg, caption = None, f"could not be drawn ({type(exc).__name__}: {str(exc)[:160]})"
        if svg is None:
            notes.append(f"<li>{_e(name)}: {_e(caption)}</li>")
        else:
            data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
            parts.append(
                f'<figure><img alt="{_e(name)}" src="data:image/svg+xml;base64,{data}">'
                f"<figcaption>{_e(caption)}</figcaption></figure>"
            )
    left_out = f'<ul class="note">{"".join(notes)}</ul>' if notes else ""
    return f"<section><h2>Figures</h2>{''.join(parts)}{left_out}</section>"


Drawn = tuple[str | None, str]  # (svg, caption) or (None, why it is left out)


def _samples(folder: RunFolder, c: Any) -> tuple[list[Sample], list[Sample], int] | str:
    """The grader's own samples, recomputed from the stored history: (treatment, reference, positions)."""
    h, config = folder.history, folder.config
    if h is None or config is None:
        return "the run folder holds no workload"
    if Arm.REFERENCE not in h.arms():
        return "needs a reference server (the run had none)"
    n = graders.compared_positions(h, config.grading)
    margin = config.grading.hard_margin
    t = graders.samples(h, Arm.TREATMENT, c.pairs, c.where, margin, n)
    r = graders.samples(h, Arm.REFERENCE, c.pairs, c.where, margin, n)
    if not t or not r:
        return f"no {c.region} hits to compare (treatment {len(t)}, reference {len(r)})"
    return t, r, n


def _deviation_plot(folder: RunFolder, c: Any, plots: Any) -> Drawn:
    found = _samples(folder, c)
    if isinstance(found, str):
        return None, found
    t, r, n = found
    fig = folder.figures(c.check)
    status = (folder.finding(c.check) or {}).get("status", "not judged")
    failed = status == "FAIL"
    counted = {(int(m["unit"]), m.get("kind")) for m in fig.get("mismatches") or []}
    ranked = sorted((s.deviation for s in r), reverse=True)
    largest = fig.get("detectable_deviation", ranked[0])
    deep = fig.get("detectable_deviation_deep", ranked[min(RANKS, len(ranked)) - 1])
    # Since 2026-12-04 the exceedance thresholds sit at a margin over the reference's values (older folders: none).
    margin = fig.get("exceedance_margin")
    times = f"{margin:g}x " if margin else ""
    thresholds = [(f"{times}reference's largest", largest)]
    if deep != largest:
        thresholds.append((f"{times}reference's {RANKS}th largest", deep))
    svg = plots.deviations(
        [s.deviation for s in t],
        [s.deviation for s in r],
        flagged=[(s.unit, s.label) in counted for s in t],
        thresholds=thresholds,
        title=f"{c.check}: {c.region} hits, treatment vs reference",
        flagged_label="counted against it" if failed else "listed by the grader",
    )
    return svg, (
        f"{c.check} ({status}): how far each {c.region} hit deviates from its recomputation on the same server, "
        f"over the first {n} answer positions "
        + (
            "(red: hits the grader counted against the treatment; "
            if failed
            else "(red: hits the grader lists, beyond the reference's largest or counted, not significant together; "
        )
        + "dashed: its exceedance thresholds)."
    )


def _resume_plot(folder: RunFolder, plots: Any) -> Drawn:
    h = folder.history
    if h is None or not h.plans:
        return None, "no multiturn conversations in this run"
    flagged = _flagged_conversations(folder)
    rows = []
    for p in h.plans:
        t1 = h.get(p.index, Arm.TREATMENT, Kind.TURN1)
        answer = (t1.completion_tokens if t1 is not None else None) or p.turn1_max_tokens
        cached = {arm: _cached(h.get(p.index, arm, Kind.TURN2)) for arm in (Arm.TREATMENT, Arm.REFERENCE)}
        rows.append(plots.Resume(p.index, p.turn1_prompt_tokens, answer, cached, p.index in flagged))
    if not any(r.cached.get(Arm.TREATMENT) is not None for r in rows):
        return None, "no turn-2 answer reported cached_tokens"
    trig = folder.figures("trigger")
    caption = "A hit that ends past turn 1's prompt resumed from blocks written while turn 1 was decoding."
    if trig:
        caption += f" {trig.get('decode_region_hits')} of {trig.get('conversations')} did (need {trig.get('needed')})."
    return plots.resumes(rows, h.block_size), caption


def _cached(e: Exchange | None) -> int | None:
    return e.cached_tokens if e is not None and e.ok else None


def _acceptance_plot(folder: RunFolder, plots: Any) -> Drawn:
    fig = folder.figures("drafter-live")
    per_position = fig.get("acceptance_per_position") or {}
    if not per_position:
        why = "no drafter-live figures" if not fig else "the treatment's /metrics has no per-position acceptance"
        return None, why
    return plots.acceptance(per_position), (
        f"{_num(fig.get('drafts'))} drafts, {_num(fig.get('accepted_tokens'))} accepted tokens over the run "
        "(the treatment's /metrics delta)."
    )


def _offset_plot(folder: RunFolder, plots: Any) -> Drawn:
    fig = folder.figures("hit-geometry")
    table = fig.get("by_offset") or {}
    if not table:
        return None, "no hit-geometry sweep in this run (`--probe hit-geometry`)"
    rates = _offset_rates(table)
    block = int(fig.get("block_size") or (folder.history.block_size if folder.history else 0))
    dead = fig.get("offsets_dead") or []
    caption = "Each prompt of the sweep sent twice; the repeat should hit up to its ceiling."
    if dead:
        caption += f" Nothing hit at offsets {', '.join(map(str, dead))}."
    return plots.hit_rates(rates, block), caption


def _offset_rates(table: Mapping[str, Mapping[str, Any]]) -> dict[int, tuple[int, int]]:
    """Offset -> (repeats that hit, repeats that could: a ceiling above 0)."""
    rates = {}
    for offset, row in table.items():
        reachable = [h for h, c in zip(row.get("hit") or [], row.get("ceiling") or [], strict=False) if c and c > 0]
        rates[int(offset)] = (sum(1 for h in reachable if h), len(reachable))
    return rates


def _timeline_plot(folder: RunFolder, plots: Any) -> Drawn:
    h = folder.history
    chats = [e for e in h.exchanges if e.conversation >= 0] if h else []
    if not chats:
        return None, "no requests recorded"
    ordered = any(e.started_s is None for e in chats)
    requests = [
        plots.Request(e.arm, float(i if ordered else e.started_s or 0.0), e.elapsed_s, e.ok)
        for i, e in enumerate(chats)
    ]
    retries = [float(r["at"]) for r in folder.retries if isinstance(r.get("at"), (int, float))]
    heartbeat = folder.config.heartbeat_s if folder.config else 15.0
    caption = f"{len(chats)} chat requests, {len(retries)} retries, {sum(not e.ok for e in chats)} failed."
    if ordered:
        caption += " This run folder stores no request start times: requests are in the order recorded."
    return plots.timeline(requests, retries, heartbeat, ordered=ordered), caption


# --- flagged conversations ------------------------------------------------------------------------------


def _flagged_conversations(folder: RunFolder) -> dict[int, list[str]]:
    """Conversation -> the request kinds a non-PASS grader counted against it (what engine writes replays for)."""
    out: dict[int, list[str]] = {}
    for f in folder.findings:
        if f.get("status") == "PASS" or f.get("check") == "race-divergence":  # race units are rounds
            continue
        fig = f.get("figures") or {}
        for m in fig.get("mismatches") or []:
            out.setdefault(int(m["unit"]), []).append(str(m.get("kind") or Kind.TURN2))
        for c in fig.get("forward_flips") or []:
            out.setdefault(int(c), []).append(Kind.TURN2)
    return out


def _race_rounds(folder: RunFolder) -> str:
    fig = folder.figures("race-divergence")
    if (folder.finding("race-divergence") or {}).get("status") in (None, "PASS"):
        return ""
    rounds = sorted({int(m["unit"]) for m in fig.get("mismatches") or []})
    return f"<p>Cold-race rounds counted against the treatment: {_e(', '.join(map(str, rounds)) or 'none')}.</p>"


def _flagged(folder: RunFolder) -> str:
    flagged = _flagged_conversations(folder)
    replays = sorted((folder.path / "replay").glob("*.sh"))
    race = _race_rounds(folder)
    if not flagged:
        example = f" ({len(replays)} replay scripts of one conversation are kept as an example)" if replays else ""
        return (
            f"<section><h2>Flagged conversations</h2><p>None{_e(example)}.</p>{race}{_replays(folder, replays)}"
            "</section>"
        )
    parts = [
        race,
        f"<p>{len(flagged)} conversation(s) counted against the treatment: {_e(', '.join(map(str, sorted(flagged))))}."
        " Each replay script re-sends one request (the API key is read from the variable or file the run used, "
        "never stored).</p>",
    ]
    for conv in sorted(flagged)[:_DETAILED]:
        kinds = list(dict.fromkeys(flagged[conv]))
        mine = [p for p in replays if p.name.startswith(f"c{conv:03d}-")]
        diffs = "".join(_diff(folder, conv, k) for k in kinds)
        parts.append(f'<div class="conv"><h3>Conversation {conv}</h3>{diffs}{_replays(folder, mine)}</div>')
    if len(flagged) > _DETAILED:
        parts.append(f"<p>{len(flagged) - _DETAILED} more: see replay/ in the run folder.</p>")
    return f"<section><h2>Flagged conversations</h2>{''.join(parts)}</section>"


def _replays(folder: RunFolder, scripts: Sequence[Path]) -> str:
    if not scripts:
        return ""
    items = []
    for p in scripts:
        rel = p.relative_to(folder.path)
        body = p.read_text(encoding="utf-8", errors="replace")
        items.append(f"<details><summary><code>sh {_e(str(rel))}</code></summary><pre>{_e(body)}</pre></details>")
    return f'<div class="replays">{"".join(items)}</div>'


def _diff(folder: RunFolder, conv: int, kind: str) -> str:
    h = folder.history
    twin = _TWIN.get(kind) or (Kind.fresh(kind) if kind.startswith(Kind.RESUME) else None)
    if h is None or twin is None:
        return ""
    hit, fresh = h.get(conv, Arm.TREATMENT, kind), h.get(conv, Arm.TREATMENT, twin)
    if hit is None or fresh is None:
        return f'<p class="note">{_e(kind)}: the hit or its recomputation is not in exchanges.jsonl</p>'
    n = graders.compared_positions(h, folder.config.grading) if folder.config else None
    rows = []
    for i in range(min(_DIFF_TOKENS, max(len(hit.tokens), len(fresh.tokens)))):
        a, b = _at(hit.tokens, i), _at(fresh.tokens, i)
        differs = a is None or b is None or a.token != b.token
        gap = a.gap(b) if a is not None and b is not None else math.inf
        cls = " ".join(c for c in ("differs" if differs else "", "" if n is None or i < n else "uncompared") if c)
        rows.append(f'<tr class="{cls}"><td>{i}</td>{_tok(a)}{_tok(b)}<td>{_num(gap)}</td></tr>')
    head = (
        f"<tr><th>#</th><th colspan=2>hit ({_e(hit.case_id)}, {hit.cached_tokens} cached)</th>"
        f"<th colspan=2>recomputation ({_e(fresh.case_id)})</th><th>|Δ| nat</th></tr>"
    )
    plan = h.plan(conv)
    answer = plan.answer if plan is not None else ""
    texts = (
        f'<div class="texts"><div><b>hit</b><pre>{_e(hit.text or hit.error or "")}</pre></div>'
        f"<div><b>recomputation</b><pre>{_e(fresh.text or fresh.error or '')}</pre></div></div>"
    )
    note = f"Needle: <code>{_e(answer)}</code>. " if answer else ""
    if n is not None:
        note += f"Positions from {n} on (grey) are not compared by the graders."
    return (
        f"<h4>{_e(kind)}: hit vs recomputation (same server, fresh cache_salt)</h4><p>{note}</p>"
        f'<table class="diff">{head}{"".join(rows)}</table>{texts}'
    )


def _at(tokens: Sequence[TokenLogprob], i: int) -> TokenLogprob | None:
    return tokens[i] if i < len(tokens) else None


def _tok(t: TokenLogprob | None) -> str:
    if t is None:
        return '<td class="tok">—</td><td></td>'
    shown = t.token.replace(" ", "·").replace("\n", "⏎")
    return f'<td class="tok"><code>{_e(shown)}</code></td><td>{t.logprob:.4f}</td>'


def _files(folder: RunFolder) -> str:
    names = sorted(
        str(p.relative_to(folder.path))
        for p in folder.path.rglob("*")
        if p.is_file() and p.name != REPORT and "replay" not in p.parts and "servers" not in p.parts
    )
    items = "".join(f'<li><a href="{_e(n)}">{_e(n)}</a></li>' for n in names)
    notes = "".join(f"<li>{_e(n)}</li>" for n in folder.notes)
    return (
        f'<section><h2>Run folder</h2><ul class="files">{items}</ul>'
        + (f'<p>Not in this folder:</p><ul class="note">{notes}</ul>' if notes else "")
        + "</section>"
    )


# --- several runs on one page ---------------------------------------------------------------------------


def compare(run_dirs: Sequence[Path], out: Path) -> Path:
    """Each run's own report.html, and `out`: one row per run with a link to it (a version matrix, a series)."""
    rows = []
    for run_dir in run_dirs:
        page = write(run_dir)
        folder = read(run_dir)
        rows.append(_row(folder, os.path.relpath(page, out.parent)))
    head = "".join(
        f"<th>{h}</th>"
        for h in ("run", "verdict", "class", "exit", "vLLM", "model", "trigger", "decode hits |Δ|", "could see", "s")
    )
    body = (
        f'<section><h2>{len(rows)} runs</h2><table class="evidence compare"><tr>{head}</tr>{"".join(rows)}</table>'
        "<p>|Δ|: median and largest finite deviation of the treatment's decode-region hits (reference in "
        "brackets); could see: the smallest fraction of hits beyond the reference's largest deviation that the "
        "logprob grader would have caught with probability 0.95.</p></section>"
    )
    out.write_text(_page("blackbox: runs compared", body), encoding="utf-8")
    return out


def _row(folder: RunFolder, link: str) -> str:
    v = folder.verdict or {}
    status = _status(folder)
    trig, lp = folder.figures("trigger"), folder.figures("logprob")
    t, r = lp.get("subject_deviation") or {}, lp.get("yardstick_deviation") or {}
    dev = f"{_num(t.get('median'))} / {_num(t.get('max_finite'))}"
    dev += f" ({_num(r.get('median'))} / {_num(r.get('max_finite'))})"
    q = lp.get("detectable_fraction")
    cells = [
        f'<a href="{_e(link)}">{_e(folder.path.name)}</a>',
        f'<span class="st">{_e(status)}</span>',
        _e(v.get("error_class") or ""),
        _e(v.get("exit_code", "")),
        _e(((folder.servers.get(Arm.TREATMENT) or {}).get("version")) or "?"),
        _e((folder.config.model if folder.config else None) or _served_model(folder) or "?"),
        _e(f"{trig.get('decode_region_hits')}/{trig.get('conversations')}" if trig else ""),
        _e(dev if t else ""),
        _e(f"{q:.0%}" if isinstance(q, (int, float)) else ""),
        _e(f"{v['elapsed_s']:.0f}" if isinstance(v.get("elapsed_s"), (int, float)) else ""),
    ]
    return f'<tr class="{_e(status)}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


# --- the page -------------------------------------------------------------------------------------------


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:1em 2em;color:#222}
h1{font-size:1.3em;margin:.2em 0}
h2{font-size:1.1em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1em}
h4{font-size:.95em;margin:.8em 0 .2em}
.banner{border-radius:6px;padding:.8em 1.2em;border-left:10px solid #888;background:#f4f4f4}
.banner.PASS{border-color:#2e7d32;background:#edf7ed}
.banner.FAIL{border-color:#c62828;background:#fdecea}
.banner.UNKNOWN{border-color:#ef8f00;background:#fff4e0}
.banner.ERROR{border-color:#555;background:#eee}
.status{font-size:1.6em;font-weight:700}
.status .class,.status .exit{font-size:.6em;font-weight:400;margin-left:.8em}
.reason{font-weight:600}
.hint{color:#444}
.note{color:#666}
.meaning{margin:.2em 0;color:#444}
table{border-collapse:collapse;width:100%;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
table.kv th{width:9em;background:#fafafa}
tr.FAIL .st{color:#c62828;font-weight:700}
tr.UNKNOWN .st,tr.ERROR .st{color:#b26a00;font-weight:700}
tr.PASS .st{color:#2e7d32}
figure{margin:1em 0}
figure img{max-width:100%}
figcaption{color:#555;font-size:12px}
table.diff{width:auto}
table.diff tr.differs{background:#fdecea}
table.diff tr.uncompared{color:#999}
.texts{display:flex;gap:1em}
.texts div{flex:1;min-width:0}
pre{white-space:pre-wrap;word-break:break-all;background:#f7f7f7;padding:.4em;font-size:12px}
.conv{border-top:1px dashed #ccc;margin-top:1em}
ul.files{columns:3;font-size:12px}
footer{margin-top:2em;color:#888;font-size:12px}
"""


def _page(title: str, body: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'\">"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{_e(title)}</h1>{body}<footer>blackbox {__version__} · written {now}</footer></body></html>\n"
    )


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value))


def _num(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "n/a" if value is None else str(value)
    if value == math.inf:
        return "∞"
    if float(value).is_integer() and abs(value) < 1e12:  # counts: 2730 drafts, not 2.73e+03
        return str(int(value))
    return f"{value:.3g}"


def _nat(value: Any) -> str:
    if value == math.inf:
        return "a confident token flip"
    return f"{_num(value)} nat"
