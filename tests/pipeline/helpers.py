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


def not_utf8(values: list[str | None], bad: int) -> pa.Array:
    """A string array whose value at `bad` starts with bytes that are not UTF-8 (Parquet does not
    check; such files exist). The value must be at least two characters long."""
    array = pa.array(values, pa.string())
    validity, offsets, data = array.buffers()
    start = int.from_bytes(offsets.to_pybytes()[4 * bad:4 * bad + 4], "little")
    raw = bytearray(data.to_pybytes())
    raw[start:start + 2] = b"\xff\xfe"
    return pa.Array.from_buffers(pa.string(), len(values), [validity, offsets, pa.py_buffer(raw)])


def corrupt_page(path: Path, group: int, column: int) -> None:
    """Overwrite the start of a column chunk's first data page (the footer stays intact)."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(column)
    data = bytearray(path.read_bytes())
    data[chunk.data_page_offset:chunk.data_page_offset + 40] = b"\xab" * 40
    path.write_bytes(bytes(data))
