"""PNG plots for the bench and job reports (matplotlib's object API: no pyplot, no global state).

Each function draws one figure, writes it to `path` and returns what it drew as
{series label: [(x, y), ...]}, or None (and writes nothing) when there is nothing to draw.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pipeline.atomic import write_bytes_atomically
from pipeline.bench.aggregate import (
    Key,
    Summary,
    batch_sizes,
    ceiling_ks,
    engine_ks,
    speedup_vs_k0,
)
from pipeline.bench.metrics import CEILING, variant_label
from pipeline.config import JobError
from pipeline.stats import Counts

Series = dict[str, list[tuple[float, float]]]
_SIZE = (7.0, 4.2)
_DPI = 110


def report_dir(out: Path) -> Path:
    """`out`, made a directory if it is not one; a file there is a user error naming --out."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JobError(f"--out {out}: cannot make it a directory "
                       f"({exc.strerror or exc})") from None
    return out


def drop_undrawn(out: Path, plots: dict[str, str], drawn: dict[str, Series | None]) -> None:
    """Removes the PNGs of plots not drawn this time: an earlier report's would stay beside a
    report.md that says they were not drawn."""
    for name, file in plots.items():
        if drawn.get(name) is None:
            (out / file).unlink(missing_ok=True)


def _save(fig: Figure, path: Path) -> None:
    """Drawn in memory, then written in one rename: a full disk leaves no cut-off PNG."""
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=_DPI)
    write_bytes_atomically(str(path), png.getvalue())


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=_SIZE)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def plot_throughput(summaries: dict[Key, Summary], path: Path) -> Series | None:
    """Median output tokens/s against batch size, one line per variant; bars span the repeats."""
    lines: dict[str, list[Summary]] = {}
    for s in summaries.values():
        if s.tokens_per_s:
            lines.setdefault(variant_label(s.variant, s.k), []).append(s)
    if not lines:
        return None
    fig, ax = _figure("Output tokens/s by batch size", "batch size (max concurrent requests)",
                      "output tokens/s (median)")
    series: Series = {}
    for label, points in lines.items():
        xs = [s.batch_size for s in points]
        ys = [s.tokens_per_s or 0.0 for s in points]
        runs = [[r["output_tokens_per_s"] for r in s.runs] for s in points]
        low = [y - min(values) for y, values in zip(ys, runs, strict=True)]
        high = [max(values) - y for y, values in zip(ys, runs, strict=True)]
        ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=label)
        series[label] = [(float(x), y) for x, y in zip(xs, ys, strict=True)]
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes(summaries), [str(b) for b in batch_sizes(summaries)])
    ax.set_ylim(bottom=0)
    ax.legend()
    _save(fig, path)
    return series


def plot_speedup(summaries: dict[Key, Summary], path: Path) -> Series | None:
    """Tokens/s with k draft tokens over tokens/s without a drafter, one line per batch size
    (and, with --ceiling, a dashed line of the same colour for perfect drafts)."""
    ks = engine_ks(summaries)
    if 0 not in ks or len(ks) < 2:
        return None
    fig, ax = _figure("Speculative decoding speedup by k", "draft tokens per step (k)",
                      "speedup over no drafter (tokens/s)")
    series: Series = {}
    for b in batch_sizes(summaries):
        points = [(float(k), r) for k in ks if (r := speedup_vs_k0(summaries, b, k)) is not None]
        if not points:
            continue
        line = ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                       label=f"batch {b}")[0]
        series[f"batch {b}"] = points
        ceiling = [(float(k), r) for k in ceiling_ks(summaries)
                   if (r := speedup_vs_k0(summaries, b, k, CEILING)) is not None]
        if ceiling:
            ax.plot([0.0] + [x for x, _ in ceiling], [1.0] + [y for _, y in ceiling],
                    marker="^", linestyle="--", color=line.get_color(),
                    label=f"batch {b}, perfect drafts")
            series[f"batch {b}, perfect drafts"] = [(0.0, 1.0), *ceiling]
    if not series:
        return None
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_ylim(bottom=0)
    ax.set_xticks(ks)
    ax.legend()
    _save(fig, path)
    return series


def plot_acceptance(by_line: dict[str, Counts], path: Path,
                    title: str = "Acceptance by draft position") -> Series | None:
    """Share of draft steps whose draft token at position j was accepted, one line per entry of
    by_line (e.g. per k, or the job total)."""
    series: Series = {}
    for label, counts in by_line.items():
        rates = counts.derived()["per_position_acceptance"]
        if rates:
            series[label] = [(float(j + 1), rate) for j, rate in enumerate(rates)]
    if not series:
        return None
    fig, ax = _figure(title, "draft position", "accepted / draft steps")
    for label, points in series.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    longest = max(len(points) for points in series.values())
    ax.set_xticks(range(1, longest + 1))
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    _save(fig, path)
    return series


def plot_over_time(segments: Sequence[Sequence[tuple[float, float]]], path: Path, title: str,
                   xlabel: str, ylabel: str) -> Series | None:
    """One line per segment (points in a segment are joined, segments are not: a gap where
    nothing ran), in one colour."""
    points = [point for segment in segments for point in segment]
    if not points:
        return None
    fig, ax = _figure(title, xlabel, ylabel)
    for segment in segments:
        ax.plot([x for x, _ in segment], [y for _, y in segment], marker="o", linestyle="-",
                color="tab:blue")
    ax.set_ylim(bottom=0)
    _save(fig, path)
    return {ylabel: points}


def plot_bars(labels: Sequence[str], values: Sequence[float], path: Path, title: str,
              xlabel: str, ylabel: str) -> Series | None:
    if not labels:
        return None
    fig, ax = _figure(title, xlabel, ylabel)
    ax.bar(range(len(labels)), values, color="tab:red")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    step = _label_step(len(labels), max(map(len, labels)))
    ax.set_xticks(range(0, len(labels), step), list(labels)[::step])
    ax.set_ylim(0, max(1.0, max(values) * 1.15))
    _save(fig, path)
    return {ylabel: [(float(i), float(v)) for i, v in enumerate(values)]}


_LABEL_CHARS = 64  # tick-label characters (and a space after each) a plot's width takes


def _label_step(count: int, longest: int) -> int:
    """Every how many bars a tick is labelled: a round step (1, 2, 5, 10, 20, 25, 50, 100, ...)
    that keeps the labels, `longest` characters at most, from running together (470 shards
    labelled every 23rd: '...92 115138161184...')."""
    fits = max(1, _LABEL_CHARS // (longest + 1))
    scale = 1
    while True:
        for step in (scale, 2 * scale, 5 * scale) if scale == 1 else (
                scale, 2 * scale, 25 * scale // 10, 5 * scale):
            if -(-count // step) <= fits:
                return step
        scale *= 10
