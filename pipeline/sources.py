"""Finding the input files, checking them before anything is generated, cutting them into shards.

A shard is `shard_rows` consecutive rows of one file (shards never span files); shards are numbered
globally in input order, and shard k is written to part-{k:05d}.parquet.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import JobConfig, JobError, one_line
from pipeline.discover import Partitions, discover_inputs, part_name
from pipeline.schema import (
    OVERRIDE_COLUMNS,
    check_input_schema,
    python_values,
    schema_difference,
)

_SCAN_BATCH_ROWS = 8_192


@dataclass(frozen=True)
class InputFile:
    path: str  # as found from INPUT (relative paths stay relative, for readable messages)
    size: int
    mtime_ns: int
    num_rows: int
    row_group_rows: tuple[int, ...]
    # row groups the scan could not read whole (a corrupt page): (group, why). Their rows come
    # back as error rows, with the columns that can still be read on their own
    unreadable_groups: tuple[tuple[int, str], ...] = ()
    # a digest of the Parquet footer (row groups' offsets, sizes and column statistics): tells
    # a file rewritten with its old size and modification time (`touch -r`) from the original
    footer: str = ""
    # the first input file's column order, where this file has its columns in another order
    # (its rows are read in that order, so every part file has one schema); () when the same
    columns: tuple[str, ...] = ()
    # Hive partition values from the folders under a directory INPUT (lang=en/part-0.parquet:
    # (("lang", "en"),)), added to its rows as string columns (pipeline.discover.Found)
    partitions: Partitions = ()
    # its path under a directory INPUT without the suffix, for files in partition folders: the
    # prefix of generated ids (pipeline.discover.Found); "" for the file's stem
    id_prefix: str = ""

    @property
    def id_stem(self) -> str:
        """What ids made for its rows start with: '<id_stem>:<row index>'."""
        return self.id_prefix or os.path.splitext(os.path.basename(self.path))[0]

    def fingerprint(self) -> dict[str, Any]:
        """What a resume compares (pipeline.manifest); partitions only where the file has them,
        so a job started from a glob is not resumed from the directory (its rows would gain
        the partition columns, its ids another prefix), nor the other way round."""
        fields: dict[str, Any] = {"path": os.path.abspath(self.path), "size": self.size,
                                   "mtime_ns": self.mtime_ns, "footer": self.footer}
        if self.partitions:
            fields["partitions"] = [list(pair) for pair in self.partitions]
        elif self.id_prefix:  # a glob's files of one name: ids from its spelling of the path
            fields["ids"] = self.id_prefix
        return fields

    def row_groups(self) -> Iterator[tuple[int, int, int]]:
        """(row group, its first row, its rows), in file order."""
        start = 0
        for group, rows in enumerate(self.row_group_rows):
            yield group, start, rows
            start += rows


@dataclass(frozen=True)
class Shard:
    shard_id: int
    file: InputFile
    start: int  # first row, within the file
    stop: int  # one past the last row

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    @property
    def part_name(self) -> str:
        return part_name(self.shard_id)

    def row_groups(self) -> list[tuple[int, int, int]]:
        """The file's row groups (group, first row, rows) that hold some of the shard's rows."""
        return [(group, start, rows) for group, start, rows in self.file.row_groups()
                if start < self.stop and start + rows > self.start]


class InputPlan(NamedTuple):
    files: list[InputFile]
    schema: pa.Schema  # of every input file
    has_id_column: bool  # False: ids are made as "<InputFile.id_stem>:<row index>"
    shards: list[Shard]


def open_inputs(config: JobConfig) -> tuple[list[InputFile], pa.Schema, bool]:
    """Read every file's footer and check its schema (cheap: no row data is read)."""
    files: list[InputFile] = []
    first_schema: pa.Schema | None = None
    has_id = False
    for path, partitions, id_prefix in discover_inputs(config.input, config.output_dir):
        try:
            meta = pq.ParquetFile(path).metadata
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: a name not UTF-8
            raise JobError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
        if first_schema is None:
            first_schema = schema
            read_schema = _with_partitions(schema, partitions, path, config)
            has_id = check_input_schema(read_schema, path, config)
        elif (difference := schema_difference(schema, first_schema)) is not None:
            raise JobError(f"{path}: its schema differs from {files[0].path}'s: {difference}; "
                           f"every input file must have the same columns and types")
        stat = os.stat(path)
        groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        order = tuple(first_schema.names) if schema.names != first_schema.names else ()
        files.append(InputFile(path, stat.st_size, stat.st_mtime_ns, meta.num_rows, groups,
                               footer=footer_digest(path), columns=order, partitions=partitions,
                               id_prefix=id_prefix))
    assert first_schema is not None
    if not has_id:
        _check_stems_unique(files, config.id_column)
    return files, read_schema, has_id


def _with_partitions(schema: pa.Schema, partitions: Partitions, path: str,
                     config: JobConfig) -> pa.Schema:
    """The schema of a file's rows as the job reads them: its columns, then one string column
    per Hive partition key. A key that names a column of the file, or one the job reads (the
    id, prompt or messages column, a per-row override), is refused: the job reads those from
    the files' own columns."""
    read = {config.id_column: "the id column (--id-column)",
            config.prompt_column: "the prompt column (--prompt-column)",
            **{name: f"a per-row {name}" for name in OVERRIDE_COLUMNS}}
    if config.messages_column is not None:
        read[config.messages_column] = "the messages column (--messages-column)"
    for key, _ in partitions:
        if key in schema.names:
            raise JobError(f"{path}: partition folder {key}=... names a column the file has; "
                           f"rename the folder or the column")
        if key in read:
            raise JobError(f"{path}: partition folder {key}=... names {read[key]}, which is read "
                           f"from the files' own columns, not from folder names (whose values "
                           f"are strings); rename the folder")
    return pa.schema(list(schema) + [pa.field(key, pa.string()) for key, _ in partitions],
                     metadata=schema.metadata)


def open_parquet(path: str) -> pq.ParquetFile:
    """An input file for reading its rows: pages that carry a CRC are checked against it, so a
    corrupt page of a file written with checksums is an unreadable row group, not silently
    different text."""
    return pq.ParquetFile(path, page_checksum_verification=True)


def footer_digest(path: str) -> str:
    """sha256 (16 hex digits) of the file's Parquet footer, read as bytes (the file's last
    8 + footer-length bytes; pyarrow has just read them, so they are cached)."""
    with open(path, "rb") as f:
        f.seek(-8, os.SEEK_END)
        length = int.from_bytes(f.read(4), "little")
        f.seek(-8 - length, os.SEEK_END)
        return hashlib.sha256(f.read(length)).hexdigest()[:16]


def plan_shards(files: list[InputFile], shard_rows: int) -> list[Shard]:
    """E.g. files of 5 and 3 rows, shard_rows=2: shards 0-4 are (f0, rows 0-2) (f0, 2-4) (f0, 4-5)
    (f1, 0-2) (f1, 2-3), where (f, a-b) is rows a..b-1 of file f."""
    shards: list[Shard] = []
    for f in files:
        for start in range(0, f.num_rows, shard_rows):
            shards.append(Shard(len(shards), f, start, min(start + shard_rows, f.num_rows)))
    if not shards and files:  # no rows at all: one empty part file, so readers find the schema
        shards.append(Shard(0, files[0], 0, 0))
    return shards


def scan_inputs(files: list[InputFile], config: JobConfig, has_id: bool) -> list[InputFile]:
    """Read every row once, streaming, so that a bad id stops the job before anything is
    generated, and a row group that cannot be read (a corrupt page) is known before its shard
    runs: the files come back with their unreadable groups noted (their rows become error rows;
    the job goes on with the others), and each is named on stderr. A group whose ids cannot be
    read either stops the job. Only a 64-bit hash of each id is kept (8 bytes a row); when two
    hashes collide, a second pass over the colliding ids tells a real duplicate from a hash
    collision."""
    hashes = array("q")
    scanned = []
    for f in files:
        parquet = open_parquet(f.path)
        unreadable = []
        for group, start, rows in f.row_groups():
            try:
                group_hashes = _scan_group(parquet, f, group, start, config, has_id, None)
            except _Unreadable as exc:
                message = _unreadable_message(f, group, start, rows, exc.reason)
                group_hashes = array("q")
                if has_id:
                    try:
                        group_hashes = _scan_group(parquet, f, group, start, config, has_id,
                                                   [config.id_column])
                    except _Unreadable as again:
                        raise JobError(f"{_unreadable_message(f, group, start, rows, again.reason)}"
                                       f", its id column {config.id_column!r} included") from None
                unreadable.append((group, message))
                print(f"{message}; its {rows} rows will be error rows", file=sys.stderr)
            hashes.extend(group_hashes)
        scanned.append(replace(f, unreadable_groups=tuple(unreadable)) if unreadable else f)
    if has_id and len(hashes) > 1:
        ordered = np.sort(np.frombuffer(hashes, dtype=np.int64))
        repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
        if repeated:
            _find_duplicate(scanned, config.id_column, repeated)
    return scanned


def plan_inputs(config: JobConfig) -> InputPlan:
    files, schema, has_id = open_inputs(config)
    files = scan_inputs(files, config, has_id)
    return InputPlan(files, schema, has_id, plan_shards(files, config.shard_rows))


class _Unreadable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _unreadable_message(f: InputFile, group: int, start: int, rows: int, reason: str) -> str:
    return f"{f.path}: cannot read row group {group} (rows {start}-{start + rows - 1}): {reason}"


def _scan_group(parquet: pq.ParquetFile, f: InputFile, group: int, start: int,
                config: JobConfig, has_id: bool, columns: list[str] | None) -> array[int]:
    """Read one row group (`columns`, or all of them), a batch at a time; the hashes of its ids."""
    hashes = array("q")
    offset = start
    for batch in _read_group(parquet, group, columns):
        if has_id:
            ids = batch.column(config.id_column)
            if ids.null_count:
                row = offset + ids.is_null().to_pylist().index(True)
                raise JobError(f"{f.path}: id column {config.id_column!r} is null at row {row}")
            hashes.extend(hash(v) for v in _ids(ids, f, offset, config.id_column))
        offset += batch.num_rows
    return hashes


def _read_group(parquet: pq.ParquetFile, group: int,
                columns: list[str] | None) -> Iterator[pa.RecordBatch]:
    """The group's batches, one in memory at a time; _Unreadable where pyarrow cannot read it."""
    batches = parquet.iter_batches(_SCAN_BATCH_ROWS, row_groups=[group], columns=columns)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            raise _Unreadable(one_line(exc)) from None
        if batch is None:
            return
        yield batch


def _iter_file(f: InputFile,
               columns: list[str] | None = None) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(row offset, batch) over a whole file, one row group at a time, so that a read error can
    name the file and the rows of the row group it is in."""
    parquet = open_parquet(f.path)
    for group, start, rows in f.row_groups():
        offset = start
        try:
            for batch in _read_group(parquet, group, columns):
                yield offset, batch
                offset += batch.num_rows
        except _Unreadable as exc:
            raise JobError(_unreadable_message(f, group, start, rows, exc.reason)) from None


def _ids(ids: pa.Array, f: InputFile, offset: int, id_column: str) -> list[Any]:
    """The ids as Python values; an id that is not valid UTF-8 stops the job, named."""
    values = python_values(ids)
    for i, v in enumerate(values):
        if isinstance(v, UnicodeDecodeError):
            raise JobError(f"{f.path}: id column {id_column!r} is not valid UTF-8 at row "
                           f"{offset + i} ({v.reason} at byte {v.start})")
    return values


def _find_duplicate(files: list[InputFile], id_column: str, hashes: set[int]) -> None:
    first_seen: dict[object, tuple[str, int]] = {}
    for f in files:
        for offset, batch in _iter_file(f, [id_column]):
            for i, value in enumerate(batch.column(0).to_pylist()):
                if hash(value) not in hashes:
                    continue
                if value in first_seen:
                    path, row = first_seen[value]
                    raise JobError(f"duplicate id {value!r} in column {id_column!r}: {path} row "
                                   f"{row} and {f.path} row {offset + i}; ids must be unique"
                                   + _samples_hint(f, id_column))
                first_seen[value] = (f.path, offset + i)


def _samples_hint(f: InputFile, id_column: str) -> str:
    """Where the input is the output of a job with --n > 1 (its samples share their row's id):
    how to read it."""
    names = pq.read_schema(f.path).names
    if not any(name.endswith("sample_index") for name in names):
        return ""
    new = next(f"{id_column}_{i}" for i in range(2, len(names) + 3)
               if f"{id_column}_{i}" not in names)  # one the input does not have
    return (f" (the input is the output of a job with --n > 1, whose samples of a row share its "
            f"id: name a new id column, e.g. --id-column {new}, and ids are made from file and "
            f"row)")


def _check_stems_unique(files: list[InputFile], id_column: str) -> None:
    seen: dict[str, str] = {}
    for f in files:
        if f.id_stem in seen:
            raise JobError(f"no {id_column!r} column, and ids made from file names would repeat: "
                           f"{seen[f.id_stem]} and {f.path}; add an id column (see --id-column)")
        seen[f.id_stem] = f.path


