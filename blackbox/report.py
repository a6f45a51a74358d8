"""The console summary: the figures a maintainer asks for first, then the verdict and what to do next."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from blackbox.engine import RunResult
from blackbox.verdict import Finding, Status

__all__ = ["ProgressLine", "summary"]


def _fig(findings: Mapping[str, Finding], check: str) -> Mapping[str, Any]:
    f = findings.get(check)
    return f.figures if f else {}


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def summary(result: RunResult) -> str:
    v = result.verdict
    by_check = {f.check: f for f in v.findings}
    lines = [f"blackbox: {v.status.value}" + (f" ({v.error_class})" if v.error_class else "")]
    cache, trig, draft = _fig(by_check, "cache-live"), _fig(by_check, "trigger"), _fig(by_check, "drafter-live")
    arms = result.history.arms() if result.history else set()
    if arms and "control" not in arms:
        lines.append(
            "  mode            single endpoint: the control is the treatment's own no-reuse answers; recall grades "
            "them and sees only corruption that loses a needle; logprob and exactness need --reference; the cold "
            "race needs no other server"
        )
    if result.geometry:
        lines.append(
            f"  geometry        block {result.geometry.block_size} tokens "
            f"({result.geometry.block_size_source}), max_model_len {result.geometry.max_model_len}"
        )
    if cache:
        lines.append(
            f"  cache           hit ratio {_fmt(cache.get('hit_ratio'), '.1%')} "
            f"({_fmt(cache.get('hit_tokens'), 'g')} of {_fmt(cache.get('query_tokens'), 'g')} tokens)"
        )
    if trig:
        lines.append(
            f"  trigger         {trig.get('decode_region_hits')}/{trig.get('conversations')} turn-2 hits "
            f"reached decode-written blocks (need {trig.get('needed')})"
        )
    if draft:
        acc = ", ".join(f"{k}: {r:.2f}" for k, r in (draft.get("acceptance_per_position") or {}).items())
        lines.append(f"  drafter         {_fmt(draft.get('drafts'), 'g')} drafts, acceptance per position [{acc}]")
    rec = _fig(by_check, "recall")
    if rec:
        lines.append(
            f"  recall          hit {_fmt(rec.get('treatment_recall'), '.0%')} vs no-reuse "
            f"{_fmt(rec.get('no_reuse_recall'), '.0%')} vs control {_fmt(rec.get('control_recall'), '.0%')}; flips "
            f"{len(rec.get('forward_flips', []))} forward / {len(rec.get('reverse_flips', []))} reverse, "
            f"p = {_fmt(rec.get('p_value'))}"
        )
    rt = _fig(by_check, "race-trigger")
    if rt:
        step = rt.get("largest_step_tokens") or 0
        split = sum(1 for n in (rt.get("round_computed_tokens") or {}).values() if n > step)
        lines.append(
            f"  cold race       largest step {_fmt(step, 'g')} tokens; {split} rounds computed more; "
            f"{len(rt.get('rounds_resumed') or [])} rounds' follow-ups resumed from race-written blocks"
        )
    for check, label in (("exactness", "prefill hits"), ("logprob", "decode hits"), ("race-divergence", "race")):
        fig = _fig(by_check, check)
        if "subject_deviation" not in fig:
            continue
        t, r = fig.get("subject_deviation") or {}, fig.get("yardstick_deviation") or {}
        ps = ", ".join(f"{k} {p:.3g}" for k, p in (fig.get("p_values") or {}).items())
        lines.append(
            f"  {label:<15} |Δ| median {_fmt(t.get('median'))} (n {fig.get('n_subject')}, "
            f"{fig.get('subject_identical')} identical) vs yardstick {_fmt(r.get('median'))} "
            f"(n {fig.get('n_yardstick')}, {fig.get('yardstick_identical')} identical, max {_fmt(r.get('max_finite'))})"
        )
        q = fig.get("detectable_fraction")
        lines.append(
            f"  {'':<15} {ps}; alpha {_fmt(fig.get('alpha'))}; detects >= {_fmt(q, '.0%')} of hits "
            f"beyond {_margin(fig)}the yardstick (power {fig.get('detection_power')})"
        )
    if result.grades:
        used = ", ".join(result.grades.used) or "none"
        share = f" (alpha {result.grades.alpha_per_grader:.3g} each)" if result.grades.alpha_per_grader else ""
        lines.append(f"  graders         {used}{share}")
        lines.extend(f"                  (not used: {g}: {why})" for g, why in result.grades.not_used)
    lines.append("")
    for f in v.findings:
        mark = {Status.PASS: "ok  ", Status.FAIL: "FAIL", Status.UNKNOWN: "??  ", Status.ERROR: "ERR "}[f.status]
        lines.append(f"  [{mark}] {f.check}: {f.reason}")
        if f.hint and f.status is not Status.PASS:
            lines.append(f"         -> {f.hint}")
    lines.extend(_run_notes(result))
    lines.append("")
    lines.append(f"verdict: {v.status.value} — {v.reason}")
    lines.append(f"run folder: {result.store_path} ({result.elapsed_s:.0f} s); exit code {v.exit_code}")
    if (result.store_path / "report.html").is_file():
        lines.append(f"report: {result.store_path / 'report.html'}")
    return "\n".join(lines)


def _run_notes(result: RunResult) -> list[str]:
    """Retries and an internal error's traceback live in the run folder; the summary says where."""
    notes = []
    retries = result.store_path / "retries.jsonl"
    if retries.is_file():
        records = [json.loads(line) for line in retries.read_text().splitlines() if line.strip()]
        gave_up = sum(1 for r in records if r.get("gave_up"))
        retried = len(records) - gave_up
        notes.append(f"  retries: {retried} retried, {gave_up} given up (see {retries})")
    trace = result.store_path / "traceback.txt"
    if trace.is_file():
        notes.append(f"  traceback: {trace}")
    return notes


class ProgressLine:
    """Progress on stderr: one rewritten line on a terminal, a line every few seconds otherwise."""

    def __init__(self, stream: TextIO = sys.stderr, every_s: float = 5.0) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.every_s = every_s
        self._last = 0.0
        self._started = time.monotonic()

    def __call__(self, done: int, total: int, note: str) -> None:
        now = time.monotonic()
        if not self.tty and done not in (0, total) and now - self._last < self.every_s:
            return
        self._last = now
        count = f"{done}/{total} conversations · " if total else ""  # a cold-race-only run drives none
        text = f"[{now - self._started:5.0f}s] {count}{note}"
        if self.tty:
            self.stream.write("\r\033[K" + text)
            if done == total and note.startswith("waiting"):
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _margin(fig: Mapping[str, Any]) -> str:
    """The exceedance thresholds' margin over the yardstick, as the figures state it (folders before it: none)."""
    margin = fig.get("exceedance_margin")
    return f"{margin:g}x " if margin else ""
