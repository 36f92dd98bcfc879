"""The entry points the Click commands call: one call each."""

from __future__ import annotations

from pathlib import Path

from pipeline.bench.config import BenchConfig, ReportConfig
from pipeline.bench.metrics import BENCH_FILE


def bench(config: BenchConfig) -> Path:
    from pipeline.bench.runner import run_bench  # noqa: PLC0415  (torch only when it runs)

    return run_bench(config)


def report(config: ReportConfig) -> Path:
    """A bench directory (bench.parquet) gets the bench report redrawn; a job directory gets
    the job report."""
    if (Path(config.directory) / BENCH_FILE).is_file():
        from pipeline.bench.report import write_bench_report  # noqa: PLC0415

        return write_bench_report(config.directory, config.out_dir)
    from pipeline.bench.job_report import write_job_report  # noqa: PLC0415

    return write_job_report(config.directory, config.out_dir)
