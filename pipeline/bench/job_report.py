"""`eaglebatch report OUTPUT_DIR` for a job: report.md and plots from stats.parquet and
manifest.json, for a finished or a half-finished job.

A shard's commit time is the one the job recorded (manifest.json's `committed_at`, or
stats.parquet's column); for shards committed by versions that did not record it, its part
file's modification time (the rename that committed it; a copy of the directory changes it), and
the report says so. Without any, the plot falls back to shard order. A shard was generating from
its commit time less its seconds to its commit time; the job's output tokens/s is
its generated tokens over the time in which any shard was generating (parallel workers' shards
overlap: summing their seconds would give one worker's rate). The manifest's `runs` (one per
start of the job) split the plot where the job was stopped and resumed.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.atomic import write_bytes_atomically
from pipeline.bench import markdown as md
from pipeline.bench.job_errors import error_reasons
from pipeline.bench.job_settings import columns_line, drafter_label, sampling_line
from pipeline.bench.job_timeline import throughput_plot
from pipeline.bench.plots import (
    drop_undrawn,
    plot_acceptance,
    plot_bars,
    report_dir,
)
from pipeline.config import JobError, one_line
from pipeline.discover import is_part_name, part_name
from pipeline.manifest import (
    JOB_PLOTS,
    JOB_REPORT_FILE,
    JOB_REPORT_TITLE,
    MANIFEST_FILE,
    MISSING,
    SUCCESS_FILE,
    DamagedManifest,
    Manifest,
    load_manifest,
    unusable_parts,
)
from pipeline.stats import STATS_FILE, Counts, busy_seconds, shard_spans, total

REPORT_FILE = JOB_REPORT_FILE
PLOTS = JOB_PLOTS
_MAX_TABLE_SHARDS = 100


def write_job_report(directory: str, out_dir: str) -> Path:
    if not os.path.isdir(directory):
        what = "a file, not a directory" if os.path.exists(directory) else "no such directory"
        raise JobError(f"OUTPUT_DIR {directory}: {what}")
    stats_path = Path(directory) / STATS_FILE
    damaged_manifest = False
    try:
        manifest = load_manifest(directory)
    except DamagedManifest as exc:
        if not stats_path.is_file():
            raise JobError(f"{exc.path} is damaged ({exc.reason}), and there is no {STATS_FILE} "
                           "to report from") from None
        print(f"{exc.path} is damaged ({exc.reason}); reporting from {STATS_FILE} alone",
              file=sys.stderr)
        manifest, damaged_manifest = None, True
    if manifest is None and not stats_path.is_file():
        raise JobError(f"{directory} has no {MANIFEST_FILE}, {STATS_FILE} or bench.parquet: "
                       "not the output of an eaglebatch job or bench")
    shards, recorded = _shards(manifest, stats_path)
    stats_problem = None if manifest is None or not shards else _stats_problem(stats_path)
    if stats_problem:
        print(f"{stats_path}: {stats_problem}; reporting from {MANIFEST_FILE}", file=sys.stderr)
    unknown_steps = _steps_unknown(shards) if manifest is None else 0
    out = report_dir(Path(out_dir))
    committed = {sid: recorded[sid] if sid in recorded else _part_file_time(directory, sid)
                 for sid in shards}
    from_files = sum(1 for sid in shards if sid not in recorded and committed[sid] is not None)
    # what a resume would regenerate (with the digests a manifest keeps; by footer and row count
    # where there is none)
    problems = unusable_parts(manifest or Manifest({}, [], len(shards), shards), directory)
    missing = [sid for sid, why in problems.items() if why == MISSING]
    damaged = [sid for sid, why in problems.items() if why != MISSING]
    totals = total(shards.values())
    runs = manifest.runs if manifest is not None else []
    spans = shard_spans(shards, committed)
    drawn = {
        "throughput": throughput_plot(shards, spans, runs, out / PLOTS["throughput"]),
        "acceptance": plot_acceptance({"all shards": totals}, out / PLOTS["acceptance"]),
        "errors": plot_bars([str(s) for s in shards], [shards[s].errors for s in shards],
                            out / PLOTS["errors"], "Rows with finish_reason 'error' per shard",
                            "shard", "error rows"),
    }
    drop_undrawn(out, PLOTS, drawn)
    done = os.path.exists(os.path.join(directory, SUCCESS_FILE))
    k = manifest.config.get("num_speculative_tokens") if manifest is not None else None
    busy = None if spans is None else busy_seconds(list(spans.values()))
    sections = [_header(directory, manifest, shards, done, missing, damaged, from_files,
                        damaged_manifest, stats_problem),
                _totals(totals, busy, k, unknown_steps),
                error_reasons(directory, shards),
                _shard_table(shards, committed),
                _plot_links(drawn, totals.drafted)]
    path = out / REPORT_FILE
    write_bytes_atomically(str(path), ("\n\n".join(s for s in sections if s) + "\n").encode())
    return path


# the stats.parquet columns that hold Counts fields (the others are derived from them)
_COUNT_COLUMNS = ("rows", "errors", "prompt_tokens", "completion_tokens", "wall_seconds",
                  "drafted", "accepted")


def _shards(manifest: Manifest | None, stats_path: Path
            ) -> tuple[dict[int, Counts], dict[int, float]]:
    """Counts per committed shard: the manifest's when there is one (it has draft steps and
    per-position counts), else rebuilt from stats.parquet; and the commit times recorded."""
    if manifest is not None:
        return dict(sorted(manifest.shards.items())), dict(manifest.committed_at)
    try:
        table = pq.read_table(stats_path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise JobError(f"{stats_path}: cannot read it as Parquet ({exc}), and there is no "
                       f"readable {MANIFEST_FILE} to report from") from None
    columns = ["shard_id", *_COUNT_COLUMNS]
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise JobError(f"{stats_path} lacks the column(s) {', '.join(missing)}: not an "
                       f"eaglebatch job's {STATS_FILE}")
    derived = [c for c in ("draft_steps", "mean_acceptance_length", "per_position_acceptance")
               if c in table.column_names]
    shards: dict[int, Counts] = {}
    for i, row in enumerate(table.select(columns + derived).to_pylist()):
        shard = row["shard_id"]
        try:
            if not isinstance(shard, int) or shard < 0 or shard in shards:
                raise ValueError(f"shard_id {'null' if shard is None else repr(shard)} is not "
                                 "a shard's number, or repeats")
            shards[shard] = _counts_from_stats(row)
        except (TypeError, ValueError) as exc:
            raise JobError(f"{stats_path}: row {i}: {exc}; not an eaglebatch job's {STATS_FILE}, "
                           f"and there is no readable {MANIFEST_FILE} to report from") from None
    recorded = {}
    if "committed_at" in table.column_names:  # since 2026-12-06
        try:  # ms since the epoch
            when = table.column("committed_at").cast(pa.timestamp("ms")).cast(pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            kind = table.schema.field("committed_at").type
            raise JobError(f"{stats_path}: committed_at is {kind}, not a time; not an "
                           f"eaglebatch job's {STATS_FILE}") from None
        recorded = {sid: ms / 1000 for sid, ms in zip(table.column("shard_id").to_pylist(),
                                                      when.to_pylist(), strict=True)
                    if ms is not None}
    return dict(sorted(shards.items())), recorded


def _stats_problem(stats_path: Path) -> str | None:
    """Why a job's stats.parquet beside a readable manifest cannot be read as one (missing,
    damaged, or without its columns), or None. The report does not need it then, but its reader
    may."""
    if not stats_path.is_file():
        return "missing"
    try:
        names = pq.read_schema(stats_path).names
    except (OSError, pa.ArrowInvalid) as exc:
        return f"cannot read it as Parquet ({md.cell(one_line(exc))})"
    absent = [c for c in ("shard_id", *_COUNT_COLUMNS) if c not in names]
    return f"lacks the column(s) {', '.join(absent)}" if absent else None


def _counts_from_stats(row: dict[str, Any]) -> Counts:
    """A shard's Counts from its stats.parquet row: the accepted drafts per position come back
    from the per-position rates (accepted at j / steps), and in files without `draft_steps`
    (before 2026-12-07) the steps from the mean acceptance length (1 + accepted / steps), which
    a shard that accepted nothing does not tell (its steps are left out: _steps_unknown)."""
    counts = Counts.from_json({c: row[c] for c in _COUNT_COLUMNS})  # TypeError: not a number
    if (bad := counts.impossible()) is not None:
        raise ValueError(f"a shard's '{bad}' is {getattr(counts, bad)}")
    steps = row.get("draft_steps")
    length = row.get("mean_acceptance_length")
    rates = row.get("per_position_acceptance") or []
    if steps is not None and not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"a shard's 'draft_steps' is {steps}")
    if length is not None and not (isinstance(length, float) and math.isfinite(length)):
        raise ValueError(f"a shard's 'mean_acceptance_length' is {length}")
    if not all(isinstance(r, float) and math.isfinite(r) and r >= 0 for r in rates):
        raise ValueError(f"a shard's 'per_position_acceptance' is {rates}")
    if steps is None and counts.accepted and length is not None and length > 1:
        steps = round(counts.accepted / (length - 1))
    if steps is None:  # 0 accepted: the shard adds nothing to the rates' numerators
        return counts
    counts.draft_steps = steps
    counts.accepted_per_position = [round(rate * steps) for rate in rates]
    return counts


def _steps_unknown(shards: dict[int, Counts]) -> int:
    """Shards rebuilt from a stats.parquet without draft_steps that drafted and accepted
    nothing: their draft steps are unknown, so the acceptance length and by-position rates
    leave them out (and come out too high)."""
    return sum(1 for c in shards.values() if c.drafted and not c.draft_steps)


def _part_file_time(directory: str, shard_id: int) -> float | None:
    try:
        return os.path.getmtime(os.path.join(directory, part_name(shard_id)))
    except OSError:
        return None


def _header(directory: str, manifest: Manifest | None, shards: dict[int, Counts],
            done: bool, missing: list[int], damaged: list[int], from_files: int,
            damaged_manifest: bool = False, stats_problem: str | None = None) -> str:
    lines = [JOB_REPORT_TITLE, "", f"- directory: `{directory}`",
             f"- written {_clock(time.time())}, from the files as they were then"
             + ("" if done else " (rerun `eaglebatch report` once the job has gone on)")]
    for shard_ids, what, why in ((missing, "missing", "their rows are not on disk"),
                                 (damaged, "damaged", "their bytes are not the ones committed")):
        if shard_ids:
            names = ", ".join(part_name(s) for s in shard_ids[:_MAX_PENDING])
            more = (f" and {len(shard_ids) - _MAX_PENDING} more"
                    if len(shard_ids) > _MAX_PENDING else "")
            lines.append(f"- **{what} part files** of committed shards: {names}{more}; {why} "
                         "(rerun the job's command to generate them again)")
    if stats_problem:
        lines.append(f"- **{STATS_FILE}**: {stats_problem}; the figures here come from "
                     f"{MANIFEST_FILE} (rerunning the job's command writes {STATS_FILE} again)")
    if from_files:
        lines.append(f"- commit times of {md.plural(from_files, 'shard')} are their part files' "
                     "modification times (committed by a version that did not record them; a "
                     "copy of the directory changes them)")
    if manifest is None:
        lines.append(f"- {'a damaged' if damaged_manifest else 'no'} manifest.json: figures "
                     "come from stats.parquet only")
        unlisted = [name for name in sorted(os.listdir(directory)) if is_part_name(name)
                    and int(name[len("part-"):-len(".parquet")]) not in shards]
        if unlisted:  # without a manifest the job's size is not known: these are all it shows
            lines.append(f"- {md.plural(len(unlisted), 'part file')} that stats.parquet does not "
                         f"list ({', '.join(unlisted[:_MAX_PENDING])}"
                         + (" and more" if len(unlisted) > _MAX_PENDING else "")
                         + "): not counted here")
        return "\n".join(lines)
    config = manifest.config
    sampling = config.get("sampling")
    state = "complete (_SUCCESS written)" if done else "not complete"
    if done and (missing or damaged):
        state = ("was complete (_SUCCESS written), but part files are "
                 + " or ".join(w for w, ids in (("missing", missing), ("damaged", damaged)) if ids))
    lines += [
        f"- {len(shards)} of {manifest.num_shards} shards committed; {state}",
        f"- model `{config.get('model')}`; drafter {drafter_label(config)}"
        + (f", k = {config.get('num_speculative_tokens')}, drafts cut below confidence "
           f"{config.get('draft_confidence', 0.0)}"
           + (", int8 drafter weights" if config.get("draft_int8") else "")
           + (", n-gram lookup drafts" if config.get("draft_ngram") else "")
           if config.get("drafter") else ""),
        f"- {sampling_line(sampling)}, n {config.get('n')}, "
        f"{config.get('shard_rows')} rows per shard, {len(manifest.inputs)} input file(s)",
        columns_line(config),
    ]
    row_options = sorted({str(n) for r in manifest.runs if isinstance(r.get("row_options"), list)
                          for n in r["row_options"]})
    if row_options:
        lines.append("- per-row options from the input's columns "
                     + ", ".join(f"`{n}`" for n in row_options)
                     + " (each row's value, where not null, overrides the job's option)")
    if manifest.runs:
        what = "its start and every resume" if len(manifest.runs) > 1 else "started"
        lines.append(f"- {md.plural(len(manifest.runs), 'run')} ({what}): "
                     + "; ".join(_run(r) for r in manifest.runs[:_MAX_RUNS])
                     + ("; ..." if len(manifest.runs) > _MAX_RUNS else ""))
    pending = [s for s in range(manifest.num_shards) if s not in shards]
    if pending and not done:
        shown = ", ".join(map(str, pending[:_MAX_PENDING]))
        more = f" and {len(pending) - _MAX_PENDING} more" if len(pending) > _MAX_PENDING else ""
        lines.append(f"- shards not committed yet: {shown}{more} (rerun the job's command to "
                     "finish them)")
        written = sum(os.path.exists(os.path.join(directory, part_name(s))) for s in pending)
        if written:  # the manifest's saves are spaced (pipeline.manifest.SAVE_SPACING)
            lines.append(f"- {md.plural(written, 'part file')} of them written since the "
                         "manifest's last save: a running job commits them at its next save, a "
                         "stopped one's rerun generates them again")
    return "\n".join(lines)


_MAX_RUNS = 10
_NOT_DRAWN = {"throughput": "no shard committed yet", "acceptance": "nothing was drafted",
              "errors": "no shard committed yet"}
_MAX_PENDING = 20


def _run(run: dict[str, Any]) -> str:
    started = run.get("started")
    when = _clock(float(started)) if isinstance(started, (int, float)) else "start unknown"
    runner = str(run.get("runner", "runner unknown"))
    if runner == "ray":
        workers = run.get("workers")
        runner += (f", {md.plural(workers, 'worker')}" if isinstance(workers, int) and workers
                   else ", workers as the cluster allows (--num-workers not given)")
    return f"{when} ({runner})"


def _totals(c: Counts, busy: float | None, k: int | None, unknown_steps: int = 0) -> str:
    """busy: the seconds in which any shard was generating (None: commit times unknown);
    unknown_steps: shards whose draft steps are not known (_steps_unknown)."""
    d = c.derived()
    rows = [["rows", f"{c.rows:,}"], ["error rows", f"{c.errors:,}"],
            ["prompt tokens", f"{c.prompt_tokens:,}"],
            ["generated tokens", f"{c.completion_tokens:,}"],
            ["generation seconds (sum over shards)", _seconds(c.wall_seconds)]]
    rate = d["output_tokens_per_s"]
    note = ""
    if busy:
        rows.append(["seconds in which any shard was generating", _seconds(busy)])
        rate = c.completion_tokens / busy
        note = ("\n\noutput tokens/s: generated tokens over the seconds in which any shard was "
                "generating (the shards of parallel workers overlap; model loading and the time "
                "between runs are left out).")
    rows.append(["output tokens/s", md.num(rate)])
    if c.drafted:
        positions = " ".join(md.pct(v) for v in d["per_position_acceptance"])
        rows += [["acceptance rate", md.pct(d["acceptance_rate"])],
                 ["mean acceptance length", md.num(d["mean_acceptance_length"], 2)],
                 ["acceptance by position", positions or "–"]]
        if unknown_steps:
            note += (f"\n\nThe mean acceptance length and acceptance by position leave out "
                     f"{md.plural(unknown_steps, 'shard')} that drafted and accepted nothing, "
                     "whose draft steps this stats.parquet (written before it recorded them) "
                     "does not tell: they are too high.")
        if k is not None and len(c.accepted_per_position) > k:
            note += (f"\n\nPositions past k = {k}: n-gram lookup drafts, of which a greedy "
                     "request alone in its step may take more than k (`--draft-ngram-tokens`).")
    return "## Totals\n\n" + md.table(["total", "value"], rows) + note


def _shard_table(shards: dict[int, Counts], committed: dict[int, float | None]) -> str:
    if not shards:
        return "## Shards\n\nNo shard is committed yet."
    shown = list(shards)[:_MAX_TABLE_SHARDS]
    more = len(shards) - len(shown)
    rows = [[str(s), f"{shards[s].rows:,}", f"{shards[s].errors:,}",
             f"{shards[s].completion_tokens:,}", _seconds(shards[s].wall_seconds),
             md.num(shards[s].derived()["output_tokens_per_s"]),
             md.pct(shards[s].derived()["acceptance_rate"]), _clock(committed[s])]
            for s in shown]
    note = f"\n\n({more} more shards not listed)" if more > 0 else ""
    return "## Shards\n\n" + md.table(["shard", "rows", "errors", "tokens", "seconds",
                                       "tokens/s", "acceptance", "committed"], rows) + note


def _seconds(value: float) -> str:
    """Seconds to a tenth, or to a thousandth below 10 s (a fast shard's 0.04 s is not 0.0)."""
    return md.num(value, 3 if value < 10 else 1)


def _clock(t: float | None) -> str:
    return "–" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _plot_links(drawn: dict[str, Any], drafted: int = 0) -> str:
    """drafted: the job's drafted tokens (an acceptance plot left undrawn with some is one
    whose draft steps stats.parquet does not tell)."""
    why = dict(_NOT_DRAWN)
    if drafted:
        why["acceptance"] = ("the draft steps of the shards that drafted are not in this "
                             "stats.parquet")
    lines = ["## Plots", ""]
    for name, series in drawn.items():
        lines.append(f"![{name}]({PLOTS[name]})" if series is not None
                     else f"- {name}: not drawn ({why[name]})")
    return "\n".join(lines)
