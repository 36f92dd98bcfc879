"""Read stage: the record batches of one shard, streamed from its file's row groups."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import JobError, one_line
from pipeline.sources import Shard, open_parquet

_BATCH_ROWS = 4096


def read_shard(shard: Shard, batch_rows: int = _BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """Yield the rows [shard.start, shard.stop) of shard.file, in order, as record batches of
    the file's own columns (read_shard_table puts them in the job's order and adds the Hive
    partition columns).

    Only the row groups that overlap the shard are read. Example: row groups of 4 rows and a shard
    of rows 6-10 read row groups 1 (rows 4-8) and 2 (rows 8-12), drop rows 4-5 and stop after row 9.
    """
    groups = shard.row_groups()
    position = groups[0][1] if groups else 0  # file row index of the first row read
    _check_unchanged(shard)
    unreadable = dict(shard.file.unreadable_groups)
    try:
        parquet = open_parquet(shard.file.path)
        for group, _, _ in groups:
            batches = (iter([_salvage(parquet, group)]) if group in unreadable
                       else parquet.iter_batches(batch_rows, row_groups=[group]))
            for batch in batches:
                lo = max(shard.start - position, 0)
                hi = min(shard.stop - position, batch.num_rows)
                position += batch.num_rows
                if hi > lo:
                    yield batch.slice(lo, hi - lo)
                if position >= shard.stop:
                    return
    except (pa.ArrowException, OSError) as exc:
        raise JobError(f"{shard.file.path}: cannot read rows {shard.start}-{shard.stop} "
                       f"({one_line(exc)})") from None


def _salvage(parquet: pq.ParquetFile, group: int) -> pa.RecordBatch:
    """A row group the scan could not read whole, column by column: each column that reads on
    its own, and nulls for those that do not (its rows are error rows whatever they hold)."""
    schema = parquet.schema_arrow
    rows = parquet.metadata.row_group(group).num_rows
    columns = []
    for field in schema:
        try:
            column = parquet.read_row_group(group, columns=[field.name]).column(0)
            columns.append(column.combine_chunks() if column.num_chunks != 1 else column.chunk(0))
        except (pa.ArrowException, OSError):
            columns.append(pa.nulls(rows, field.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def unreadable_row_errors(shard: Shard) -> list[str | None] | None:
    """Per row of the shard, why it cannot be generated (its row group could not be read), or
    None where every row reads (the usual case)."""
    if not shard.file.unreadable_groups:
        return None
    errors: list[str | None] = [None] * shard.num_rows
    unreadable = dict(shard.file.unreadable_groups)
    for group, start, rows in shard.row_groups():
        if group in unreadable:
            for row in range(max(start, shard.start), min(start + rows, shard.stop)):
                errors[row - shard.start] = unreadable[group]
    return errors if any(errors) else None


def _check_unchanged(shard: Shard) -> None:
    """Refuse to read a shard from a file that changed since the job planned its shards (its row
    groups may hold other rows now: rows would be lost or read twice)."""
    f = shard.file
    try:
        stat = os.stat(f.path)
    except OSError as exc:
        raise JobError(f"{f.path}: cannot read rows {shard.start}-{shard.stop} "
                       f"({exc.strerror or exc}); was it removed during the job?") from None
    if (stat.st_size, stat.st_mtime_ns) != (f.size, f.mtime_ns):
        change = (f"size {f.size} -> {stat.st_size} bytes" if stat.st_size != f.size
                  else "modified")
        raise JobError(f"{f.path} changed while the job ran ({change}); the shards committed "
                       f"so far were read from it as it was: rerun with --overwrite to start "
                       f"over from the files as they are now")


def read_shard_table(shard: Shard) -> pa.Table:
    """The shard's rows as one table: a shard (not the dataset) is the unit held in memory."""
    batches = list(read_shard(shard))
    table = (pa.Table.from_batches(batches) if batches
             else pq.ParquetFile(shard.file.path).schema_arrow.empty_table())
    if shard.file.columns:  # its columns in another order than the first input file's
        table = table.select(list(shard.file.columns))
    for key, value in shard.file.partitions:  # Hive partition folders: one value for every row
        table = table.append_column(pa.field(key, pa.string()),
                                    pa.array([value] * table.num_rows, pa.string()))
    if table.num_rows != shard.num_rows:
        raise JobError(f"{shard.file.path}: expected {shard.num_rows} rows from row {shard.start}, "
                       f"read {table.num_rows}; was the file changed during the job?")
    return table
