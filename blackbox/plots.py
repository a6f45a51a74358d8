"""The report's figures: matplotlib (Agg) drawn to SVG text, one function per figure, data in, SVG out.

Imported only when a report is drawn, so the CLI does not pay for matplotlib on start-up.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

__all__ = ["Request", "Resume", "acceptance", "deviations", "hit_rates", "resumes", "timeline"]

matplotlib.use("Agg")  # files only: no display, whatever MPLBACKEND says
ARM_COLOURS = {"treatment": "#1f77b4", "reference": "#2ca02c", "control": "#9467bd"}
FLAGGED = "#d62728"
plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False})


def _plain(axis: Any) -> None:
    """Tick labels as plain numbers: matplotlib's default 10^x labels go through mathtext, a third of the cost."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _svg(fig: Figure, margins: Mapping[str, float]) -> str:
    fig.subplots_adjust(**margins)  # fixed margins: a layout engine would draw every figure twice more
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return out.getvalue()


def deviations(
    subject: Sequence[float],
    yardstick: Sequence[float],
    *,
    flagged: Sequence[bool],
    thresholds: Sequence[tuple[str, float]],
    title: str,
    labels: tuple[str, str] = ("treatment hits", "reference hits"),
    flagged_label: str = "counted against it",
) -> str:
    """ECDFs of the two samples on a log axis. Exact agreement (0) and confident flips (inf) have no place on a
    log axis: they are drawn at a floor and a ceiling marked as such. `flagged[i]` highlights subject[i]."""
    finite = [v for v in (*subject, *yardstick) if 0 < v < math.inf]
    floor = min(finite) / 10 if finite else 1e-3
    ceiling = max(finite) * 10 if finite else 1.0

    def place(v: float) -> float:
        return floor if v <= 0 else ceiling if v == math.inf else v

    fig, ax = plt.subplots(figsize=(7.5, 3.6), layout=None)
    for values, label, colour in ((subject, labels[0], ARM_COLOURS["treatment"]), (yardstick, labels[1], "#2ca02c")):
        if values:
            placed = sorted(place(v) for v in values)
            ys = [(i + 1) / len(placed) for i in range(len(placed))]
            ax.step(placed, ys, where="post", label=f"{label} (n {len(values)})", color=colour)
    marked = sorted((place(v), v) for v, f in zip(subject, flagged, strict=True) if f)
    if marked:
        order = sorted(place(v) for v in subject)
        ys = [(max(i for i, o in enumerate(order) if o == x) + 1) / len(order) for x, _ in marked]
        ax.scatter([x for x, _ in marked], ys, color=FLAGGED, zorder=5, s=28, label=f"{flagged_label} ({len(marked)})")
    for i, (name, value) in enumerate(thresholds):
        if 0 < value < math.inf:  # labels on alternate sides, so two close thresholds stay readable
            ax.axvline(value, color="#555", linestyle="--", linewidth=0.9)
            side = "right" if i % 2 == 0 else "left"
            ax.annotate(name, (value, 0.02), rotation=90, fontsize=7, color="#555", ha=side, va="bottom")
    ax.axvline(floor, color="#bbb", linewidth=0.8, linestyle=":")
    ax.axvline(ceiling, color="#bbb", linewidth=0.8, linestyle=":")
    ax.annotate("identical", (floor, 1.0), fontsize=7, color="#777", ha="left", va="top")
    ax.annotate("confident flip", (ceiling, 1.0), fontsize=7, color="#777", ha="right", va="top")
    ax.set_xscale("log")
    _plain(ax.xaxis)
    ax.set_xlim(floor / 1.5, ceiling * 1.5)
    ax.set_ylim(0, 1.04)
    ax.set_xlabel("deviation of the hit from its recomputation (nat, log scale)")
    ax.set_ylabel("fraction of hits ≤ x")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return _svg(fig, {"left": 0.09, "right": 0.98, "bottom": 0.14, "top": 0.91})


@dataclass(frozen=True)
class Resume:
    """Where one conversation's turn-2 hits resumed, against its turn-1 regions (tokens)."""

    conversation: int
    prompt_tokens: int  # turn 1's prompt: the prefill-written region ends here
    answer_tokens: int  # turn 1's answer: the decode-written region follows the prompt
    cached: Mapping[str, int | None]  # arm -> the turn-2 hit's cached tokens
    flagged: bool = False


def resumes(rows: Sequence[Resume], block_size: int) -> str:
    fig, ax = plt.subplots(figsize=(7.5, 1.6 + 0.16 * len(rows)), layout=None)
    ys = list(range(len(rows)))
    ax.barh(ys, [r.prompt_tokens for r in rows], color="#d9d9d9", height=0.7, label="turn-1 prompt (prefill-written)")
    ax.barh(
        ys,
        [r.answer_tokens for r in rows],
        left=[r.prompt_tokens for r in rows],
        color="#c6dbef",
        height=0.7,
        label="turn-1 answer (decode-written)",
    )
    for arm, marker, dy in (("treatment", "o", -0.18), ("reference", "x", 0.18)):  # side by side, not on top
        points = [(c, y + dy, r.flagged) for r, y in zip(rows, ys, strict=True) if (c := r.cached.get(arm)) is not None]
        if points:
            ax.scatter(
                [p[0] for p in points],
                [p[1] for p in points],
                marker=marker,
                s=22,
                color=[FLAGGED if p[2] else ARM_COLOURS[arm] for p in points],
                zorder=4,
                label=f"{arm} turn-2 hit ends",
            )
    ax.set_yticks(ys, [str(r.conversation) for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_ylabel("conversation")
    ax.set_xlabel(f"tokens (block {block_size}); a hit past the grey bar resumed from decode-written blocks")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    height = 1.6 + 0.16 * len(rows)
    fig.suptitle("Where each turn-2 hit resumed (red: a flagged conversation)", fontsize=10)
    return _svg(fig, {"left": 0.09, "right": 0.98, "bottom": 0.5 / height, "top": 1 - 0.75 / height})


def acceptance(per_position: Mapping[str, float]) -> str:
    positions = sorted(per_position, key=lambda k: int(k) if k.isdigit() else k)
    fig, ax = plt.subplots(figsize=(5.0, 2.6), layout=None)
    ax.bar([str(p) for p in positions], [per_position[p] for p in positions], color=ARM_COLOURS["treatment"])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title("Drafter acceptance by position (treatment)", fontsize=10)
    return _svg(fig, {"left": 0.14, "right": 0.97, "bottom": 0.18, "top": 0.88})


@dataclass(frozen=True)
class Request:
    arm: str
    started_s: float
    elapsed_s: float
    ok: bool


def timeline(
    requests: Sequence[Request],
    retries: Sequence[float],
    heartbeat_s: float,
    *,
    ordered: bool = False,  # True: no start times stored; x is the order requests were recorded in
) -> str:
    """Each request's latency at its start time, a mark per retry, and shaded stretches in which no request
    finished for at least a heartbeat (where the console printed 'still waiting')."""
    fig, ax = plt.subplots(figsize=(7.5, 3.4), layout=None)
    for arm in sorted({r.arm for r in requests}):
        mine = [r for r in requests if r.arm == arm and r.ok]
        ax.scatter([r.started_s for r in mine], [r.elapsed_s for r in mine], s=8, label=arm, color=ARM_COLOURS.get(arm))
    failed = [r for r in requests if not r.ok]
    if failed:
        ax.scatter([r.started_s for r in failed], [r.elapsed_s for r in failed], s=30, marker="x", color=FLAGGED)
        ax.scatter([], [], marker="x", color=FLAGGED, label=f"failed ({len(failed)})")
    ax.axhline(heartbeat_s, color="#555", linestyle="--", linewidth=0.8)
    ax.annotate(
        f"heartbeat {heartbeat_s:g} s",
        (0.01, heartbeat_s),
        xycoords=("axes fraction", "data"),
        fontsize=7,
        color="#555",
        va="bottom",
    )
    if retries and not ordered:
        ax.plot(retries, [0] * len(retries), "|", color="#ff7f0e", markersize=14, label=f"retries ({len(retries)})")
    if not ordered:
        ends = sorted(r.started_s + r.elapsed_s for r in requests)
        for a, b in itertools.pairwise(ends):
            if b - a >= heartbeat_s:
                ax.axvspan(a, b, color="#fdd0a2", alpha=0.6, zorder=0)
    ax.set_yscale("symlog", linthresh=1.0)
    _plain(ax.yaxis)
    ax.set_ylabel("latency (s)")
    ax.set_xlabel("request number, in the order recorded" if ordered else "request start (s from the run's start)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, ncol=6, frameon=False)
    fig.suptitle("Requests: latency, retries, stretches with no answer for a heartbeat", fontsize=10)
    return _svg(fig, {"left": 0.09, "right": 0.98, "bottom": 0.15, "top": 0.8})


def hit_rates(rates: Mapping[int, tuple[int, int]], block_size: int) -> str:
    """Per offset class (tokens past a block boundary where the prompt ends): repeats that hit, of those that
    could (a ceiling above 0). A class at 0 where others hit is a silent hit-rate loss."""
    offsets = sorted(rates)
    shares = [rates[o][0] / rates[o][1] if rates[o][1] else 0.0 for o in offsets]
    colours = [FLAGGED if rates[o][1] and not rates[o][0] else ARM_COLOURS["treatment"] for o in offsets]  # dead
    fig, ax = plt.subplots(figsize=(7.5, 2.8), layout=None)
    dead = [bool(rates[o][1] and not rates[o][0]) for o in offsets]
    ax.bar([str(o) for o in offsets], [0.03 if d else v for v, d in zip(shares, dead, strict=True)], color=colours)
    for i, o in enumerate(offsets):
        ax.annotate(f"{rates[o][0]}/{rates[o][1]}", (i, max(shares[i], 0.03)), ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 1.15)
    ax.set_xlabel(f"prompt ends this many tokens past a block boundary (block {block_size})")
    ax.set_ylabel("repeats that hit")
    ax.set_title("Hit rate by offset (hit-geometry sweep; red: an offset where nothing hit)", fontsize=10)
    return _svg(fig, {"left": 0.09, "right": 0.98, "bottom": 0.17, "top": 0.88})
