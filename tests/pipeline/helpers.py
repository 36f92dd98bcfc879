"""Small helpers shared by the pipeline and CLI tests: real Parquet files, read back."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(path: Path, columns: dict[str, Any], row_group_size: int | None = None,
                  schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path, row_group_size=row_group_size)
    return path


def read_parts(output_dir: Path) -> pa.Table:
    """Every part file of a job, in shard order, as one table."""
    names = sorted(n for n in os.listdir(output_dir) if n.startswith("part-"))
    return pa.concat_tables([pq.read_table(output_dir / n) for n in names])


def hidden_files(output_dir: Path) -> list[str]:
    """Hidden files other than the job lock (temp files, if any were left behind)."""
    names = os.listdir(output_dir)
    return sorted(n for n in names if n.startswith(".") and n != ".eaglebatch.lock")
