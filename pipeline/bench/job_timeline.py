"""When a job's shards generated, for `eaglebatch report OUTPUT_DIR`: each shard's span from its
commit time and seconds, the time in which any shard was generating, and the tokens/s plot over
time (split where the job was stopped and resumed)."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, TypeVar

from pipeline.bench.plots import plot_over_time
from pipeline.stats import Counts

_Value = TypeVar("_Value")  # what time_segments carries per shard


def throughput_plot(shards: dict[int, Counts], shard_spans: dict[int, tuple[float, float]] | None,
                     runs: list[dict[str, Any]], path: Path) -> Any:
    """Output tokens/s per shard: a point at each shard's commit, or where a job has more than
    _MAX_POINTS shards, the tokens/s of the shards committed in each of _BINS equal stretches
    (1,654 points of one-row shards, those of error rows at 0, drew a solid block)."""
    work = {s: (float(c.completion_tokens), c.wall_seconds) for s, c in shards.items()}
    binned = len(shards) > _MAX_POINTS
    title = (f"Output tokens/s, shards in {_BINS} stretches" if binned
             else "Output tokens/s per shard")
    if shard_spans is None:
        segments = [[(float(s), work[s]) for s in shards]]
        xlabel = "shard" + (f" ({_BINS} stretches of shards)" if binned else "")
    else:
        spans = [(begun, ended, work[s]) for s, (begun, ended) in shard_spans.items()]
        starts = sorted(float(r["started"]) for r in runs if isinstance(r.get("started"),
                                                                         (int, float)))
        origin = min(span[0] for span in spans)
        unit, scale = time_unit(max(span[1] for span in spans) - origin)
        broken = "; a break where the job stopped and resumed" if len(starts) > 1 else ""
        segments = time_segments(spans, starts, scale)
        point = "shards committed in each stretch" if binned else "a point at each commit"
        xlabel = f"{unit} since the first shard started\n({point}{broken})"
    rates = binned_rates(segments, _BINS) if binned else [
        [(x, tokens / wall if wall > 0 else 0.0) for x, (tokens, wall) in segment]
        for segment in segments]
    return plot_over_time(rates, path, title, xlabel, "output tokens/s")


_MAX_POINTS = 200
_BINS = 100


def binned_rates(segments: list[list[tuple[float, tuple[float, float]]]], bins: int
                 ) -> list[list[tuple[float, float]]]:
    """Segments of (x, (tokens, seconds)) -> segments of (middle of a stretch, tokens / seconds
    of the points in it), the x range cut into `bins` equal stretches (a stretch without points
    has none; one whose points took no time, 0.0). Example, 2 bins over x 0..4: [[(0, (10, 1)),
    (1, (30, 1)), (4, (5, 5))]] -> [[(1.0, 20.0), (3.0, 1.0)]]."""
    xs = [x for segment in segments for x, _ in segment]
    low, width = min(xs), (max(xs) - min(xs)) / bins or 1.0
    out = []
    for segment in segments:
        sums: dict[int, list[float]] = {}
        for x, (tokens, seconds) in segment:
            total_ = sums.setdefault(min(int((x - low) / width), bins - 1), [0.0, 0.0])
            total_[0] += tokens
            total_[1] += seconds
        out.append([(low + (b + 0.5) * width, t / w if w > 0 else 0.0)
                    for b, (t, w) in sorted(sums.items())])
    return out


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit a time axis of this length reads best in, and its seconds."""
    if seconds < 180:
        return "seconds", 1.0
    if seconds < 3 * 3600:
        return "minutes", 60.0
    return "hours", 3600.0


def time_segments(spans: list[tuple[float, float, _Value]], run_starts: list[float],
                  scale: float = 60.0) -> list[list[tuple[float, _Value]]]:
    """(start, commit, value) per shard -> runs of (time since the first start in `scale`
    seconds, value) at each commit, a new run at each of `run_starts` (when the job was started
    again). Example, minutes, a resume at 850 s: shards 0-60 s, 60-120 s, then 900-960 s ->
    [[(1, v0), (2, v1)], [(16, v2)]]."""
    origin = min(span[0] for span in spans)
    segments: dict[int, list[tuple[float, _Value]]] = {}
    for _, ended, rate in sorted(spans, key=lambda span: span[1]):
        run = bisect.bisect_right(run_starts, ended)
        segments.setdefault(run, []).append(((ended - origin) / scale, rate))
    return list(segments.values())
