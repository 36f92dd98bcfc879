"""`eaglebatch report OUTPUT_DIR` for a job: report.md and plots from stats.parquet and
manifest.json, for a finished or a half-finished job.

A shard's commit time is its part file's modification time (the rename that committed it), so
"over time" needs the part files; without them the plot falls back to shard order.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.bench import markdown as md
from pipeline.bench.plots import (
    drop_undrawn,
    plot_acceptance,
    plot_bars,
    plot_over_time,
    report_dir,
)
from pipeline.config import JobError
from pipeline.manifest import (
    JOB_PLOTS,
    JOB_REPORT_FILE,
    MANIFEST_FILE,
    SUCCESS_FILE,
    DamagedManifest,
    Manifest,
    load_manifest,
)
from pipeline.sources import part_name
from pipeline.stats import STATS_FILE, Counts, total
from runtime.loader import default_drafter

REPORT_FILE = JOB_REPORT_FILE
PLOTS = JOB_PLOTS
_MAX_TABLE_SHARDS = 100


def write_job_report(directory: str, out_dir: str) -> Path:
    if not os.path.isdir(directory):
        what = "a file, not a directory" if os.path.exists(directory) else "no such directory"
        raise JobError(f"OUTPUT_DIR {directory}: {what}")
    stats_path = Path(directory) / STATS_FILE
    try:
        manifest = load_manifest(directory)
    except DamagedManifest as exc:
        if not stats_path.is_file():
            raise JobError(f"{exc.path} is damaged ({exc.reason}), and there is no {STATS_FILE} "
                           "to report from") from None
        print(f"{exc.path} is damaged ({exc.reason}); reporting from {STATS_FILE} alone",
              file=sys.stderr)
        manifest = None
    if manifest is None and not stats_path.is_file():
        raise JobError(f"{directory} has no {MANIFEST_FILE}, {STATS_FILE} or bench.parquet: "
                       "not the output of an eaglebatch job or bench")
    shards = _shards(manifest, stats_path)
    out = report_dir(Path(out_dir))
    committed = {sid: _committed_at(directory, sid) for sid in shards}
    totals = total(shards.values())
    drawn = {
        "throughput": _throughput_plot(shards, committed, out / PLOTS["throughput"]),
        "acceptance": plot_acceptance({"all shards": totals}, out / PLOTS["acceptance"]),
        "errors": plot_bars([str(s) for s in shards], [shards[s].errors for s in shards],
                            out / PLOTS["errors"], "Rows with finish_reason 'error' per shard",
                            "shard", "error rows"),
    }
    drop_undrawn(out, PLOTS, drawn)
    done = os.path.exists(os.path.join(directory, SUCCESS_FILE))
    sections = [_header(directory, manifest, len(shards), done), _totals(totals),
                _shard_table(shards, committed), _plot_links(drawn)]
    path = out / REPORT_FILE
    path.write_text("\n\n".join(sections) + "\n", encoding="utf-8")
    return path


# the stats.parquet columns that hold Counts fields (the others are derived from them)
_COUNT_COLUMNS = ("rows", "errors", "prompt_tokens", "completion_tokens", "wall_seconds",
                  "drafted", "accepted")


def _shards(manifest: Manifest | None, stats_path: Path) -> dict[int, Counts]:
    """Counts per committed shard: the manifest's when there is one (it has draft steps and
    per-position counts), else rebuilt from stats.parquet."""
    if manifest is not None:
        return dict(sorted(manifest.shards.items()))
    try:
        table = pq.read_table(stats_path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise JobError(f"{stats_path}: cannot read it as Parquet ({exc}), and there is no "
                       f"{MANIFEST_FILE} to report from") from None
    columns = ["shard_id", *_COUNT_COLUMNS]
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise JobError(f"{stats_path} lacks the column(s) {', '.join(missing)}: not an "
                       f"eaglebatch job's {STATS_FILE}")
    shards = {row["shard_id"]: Counts(**{c: row[c] for c in _COUNT_COLUMNS})
              for row in table.select(columns).to_pylist()}
    return dict(sorted(shards.items()))


def _committed_at(directory: str, shard_id: int) -> float | None:
    try:
        return os.path.getmtime(os.path.join(directory, part_name(shard_id)))
    except OSError:
        return None


def _throughput_plot(shards: dict[int, Counts], committed: dict[int, float | None],
                     path: Path) -> Any:
    rates = {s: c.derived()["output_tokens_per_s"] for s, c in shards.items()}
    times = [t for t in committed.values() if t is not None]
    if not (times and len(times) == len(shards)):
        return plot_over_time([[(float(s), rates[s] or 0.0) for s in shards]], path,
                              "Output tokens/s per shard", "shard", "output tokens/s")
    spans = [(t - shards[s].wall_seconds, t, rates[s] or 0.0)
             for s, t in committed.items() if t is not None]
    return plot_over_time(time_segments(spans), path, "Output tokens/s per shard",
                          "minutes since the first shard started (at each shard's commit; a "
                          "break where the job stopped)", "output tokens/s")


def time_segments(spans: list[tuple[float, float, float]]) -> list[list[tuple[float, float]]]:
    """(start, commit, rate) per shard -> runs of (minutes since the first start, rate) at each
    commit, a new run wherever a shard started over _GAP_SECONDS after the commit before it
    (the job stopped and was resumed). Example: shards 0-60 s, 60-120 s, then 900-960 s ->
    [[(1, r0), (2, r1)], [(16, r2)]]."""
    origin = min(span[0] for span in spans)
    segments: list[list[tuple[float, float]]] = []
    last_commit = None
    for begun, ended, rate in sorted(spans, key=lambda span: span[1]):
        if last_commit is None or begun - last_commit > _GAP_SECONDS:
            segments.append([])
        segments[-1].append(((ended - origin) / 60, rate))
        last_commit = ended
    return segments


# a shard that started this long after the commit before it: the job was stopped and resumed
_GAP_SECONDS = 30.0


def _header(directory: str, manifest: Manifest | None, committed: int, done: bool) -> str:
    lines = ["# eaglebatch job report", "", f"- directory: `{directory}`"]
    if manifest is None:
        return "\n".join(lines + ["- no manifest.json: figures come from stats.parquet only"])
    config = manifest.config
    sampling = config.get("sampling", {})
    state = "complete (_SUCCESS written)" if done else "not complete"
    lines += [
        f"- {committed} of {manifest.num_shards} shards committed; {state}",
        f"- model `{config.get('model')}`; drafter {_drafter_label(config)}"
        + (f", k = {config.get('num_speculative_tokens')}, drafts cut below confidence "
           f"{config.get('draft_confidence', 0.0)}"
           + (", int8 drafter weights" if config.get("draft_int8") else "")
           + (", n-gram lookup drafts" if config.get("draft_ngram") else "")
           if config.get("drafter") else ""),
        f"- max_tokens {sampling.get('max_tokens')}, temperature {sampling.get('temperature')}, "
        f"n {config.get('n')}, {config.get('shard_rows')} rows per shard, "
        f"{len(manifest.inputs)} input file(s)",
    ]
    return "\n".join(lines)


def _drafter_label(config: dict[str, Any]) -> str:
    """The job's drafter: 'shipped (name)' for the one shipped with the model, else its path."""
    drafter = config.get("drafter")
    if not drafter:
        return "none"
    shipped = default_drafter(str(config.get("model")))
    if shipped is not None and os.path.abspath(drafter) == str(shipped):
        return f"shipped ({shipped.name})"
    return f"`{drafter}`"


def _totals(c: Counts) -> str:
    d = c.derived()
    rows = [["rows", f"{c.rows:,}"], ["error rows", f"{c.errors:,}"],
            ["prompt tokens", f"{c.prompt_tokens:,}"],
            ["generated tokens", f"{c.completion_tokens:,}"],
            ["generation seconds (sum over shards)", md.num(c.wall_seconds)],
            ["output tokens/s", md.num(d["output_tokens_per_s"])]]
    if c.drafted:
        positions = " ".join(md.pct(v) for v in d["per_position_acceptance"])
        rows += [["acceptance rate", md.pct(d["acceptance_rate"])],
                 ["mean acceptance length", md.num(d["mean_acceptance_length"], 2)],
                 ["acceptance by position", positions or "–"]]
    return "## Totals\n\n" + md.table(["total", "value"], rows)


def _shard_table(shards: dict[int, Counts], committed: dict[int, float | None]) -> str:
    shown = list(shards)[:_MAX_TABLE_SHARDS]
    more = len(shards) - len(shown)
    rows = [[str(s), f"{shards[s].rows:,}", f"{shards[s].errors:,}",
             f"{shards[s].completion_tokens:,}", md.num(shards[s].wall_seconds),
             md.num(shards[s].derived()["output_tokens_per_s"]),
             md.pct(shards[s].derived()["acceptance_rate"]), _clock(committed[s])]
            for s in shown]
    note = f"\n\n({more} more shards not listed)" if more > 0 else ""
    return "## Shards\n\n" + md.table(["shard", "rows", "errors", "tokens", "seconds",
                                       "tokens/s", "acceptance", "committed"], rows) + note


def _clock(t: float | None) -> str:
    return "–" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _plot_links(drawn: dict[str, Any]) -> str:
    lines = ["## Plots", ""]
    for name, series in drawn.items():
        lines.append(f"![{name}]({PLOTS[name]})" if series is not None
                     else f"- {name}: not drawn (no data, e.g. no drafter or no shard)")
    return "\n".join(lines)
