"""The entry points the Click commands call: one call each."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline.bench.config import BenchConfig, ReportConfig, scratch_contents, scratch_leftovers
from pipeline.bench.metrics import BENCH_FILE
from pipeline.config import JobError, one_line
from pipeline.manifest import JOB_REPORT_FILE, MANIFEST_FILE  # report.md, for bench's too
from pipeline.stats import STATS_FILE


def bench(config: BenchConfig) -> Path:
    from pipeline.bench.runner import run_bench  # noqa: PLC0415  (torch only when it runs)

    return run_bench(config)


def report(config: ReportConfig) -> Path:
    """A bench directory (bench.parquet) gets the bench report redrawn; a job directory gets
    the job report. An --out that holds another job's or bench's files is refused: the report
    written there would replace theirs."""
    for stale, size in scratch_leftovers(Path(config.directory)):
        print(f"note: {stale} ({scratch_contents(size)}) was left by a bench that was "
              "killed: delete it, or the next bench into this directory removes it",
              file=sys.stderr)
    out = Path(config.out_dir)
    elsewhere = out.is_dir() and not _same_dir(out, Path(config.directory))
    source = os.path.abspath(config.directory)
    if elsewhere:
        theirs = [n for n in (BENCH_FILE, MANIFEST_FILE, STATS_FILE) if (out / n).is_file()]
        if theirs:
            raise JobError(f"--out {out} holds {theirs[0]} of another job or bench: the report "
                           "written there would replace its own; pick another directory")
        if (out / JOB_REPORT_FILE).exists() and _reported_from(out) != source:
            raise JobError(f"--out {out} holds a {JOB_REPORT_FILE} that is not a report of "
                           f"{config.directory}: pick another directory, or remove it")
    try:
        if (Path(config.directory) / BENCH_FILE).is_file():
            from pipeline.bench.report import write_bench_report  # noqa: PLC0415

            job = [n for n in (MANIFEST_FILE, STATS_FILE) if (Path(config.directory) / n).is_file()]
            if job:
                raise JobError(f"{config.directory} holds both a bench's {BENCH_FILE} and a job's "
                               f"{job[0]}: move the bench's out to report on either")
            try:
                path = write_bench_report(config.directory, config.out_dir)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                raise JobError(f"{Path(config.directory) / BENCH_FILE}: not a bench this version "
                               f"can read ({type(exc).__name__}: {one_line(exc)})") from None
        else:
            from pipeline.bench.job_report import write_job_report  # noqa: PLC0415

            path = write_job_report(config.directory, config.out_dir)
        if not _same_dir(out, Path(config.directory)):
            (out / _SOURCE_FILE).write_text(source + "\n", encoding="utf-8")
    except OSError as exc:  # a read-only or full --out (each file is written whole or not at all)
        raise JobError(f"{exc.filename or config.out_dir}: {exc.strerror or exc}; the report is "
                       "not complete") from None
    return path


# in a report's --out elsewhere than its source: the directory it reports on, so that a later
# report of another job or bench there is refused, not written over this one
_SOURCE_FILE = ".eaglebatch-report-of"


def _reported_from(out: Path) -> str | None:
    try:
        return (out / _SOURCE_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False
