"""Finding the input files, checking them before anything is generated, cutting them into shards.

A shard is `shard_rows` consecutive rows of one file (shards never span files); shards are numbered
globally in input order, and shard k is written to part-{k:05d}.parquet.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import sys
import urllib.parse
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import JobConfig, JobError, one_line
from pipeline.schema import (
    OVERRIDE_COLUMNS,
    check_input_schema,
    python_values,
    schema_difference,
)
from pipeline.stats import STATS_FILE

_SCAN_BATCH_ROWS = 8_192
MANIFEST_FILE = "manifest.json"  # a job's, beside its part files (pipeline.manifest)


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
    # (("lang", "en"),)), added to its rows as string columns; None for __HIVE_DEFAULT_PARTITION__
    partitions: tuple[tuple[str, str | None], ...] = ()
    # its path under a directory INPUT without the suffix, for files in partition folders (whose
    # names repeat from folder to folder): the prefix of generated ids; "" for the file's stem
    id_prefix: str = ""

    @property
    def stem(self) -> str:
        return self.id_prefix or os.path.splitext(os.path.basename(self.path))[0]

    def fingerprint(self) -> dict[str, Any]:
        return {"path": os.path.abspath(self.path), "size": self.size, "mtime_ns": self.mtime_ns,
                "footer": self.footer}

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


def part_name(shard_id: int) -> str:
    return f"part-{shard_id:05d}.parquet"


_PART_NAME = re.compile(r"part-\d{5,}\.parquet")


def is_part_name(name: str) -> bool:
    """Whether `name` is a part file's (part-00000.parquet, part-123456.parquet)."""
    return _PART_NAME.fullmatch(name) is not None


class InputPlan(NamedTuple):
    files: list[InputFile]
    schema: pa.Schema  # of every input file
    has_id_column: bool  # False: ids are made as "<file stem>:<row index>"
    shards: list[Shard]


def resolve_input(spec: str, output_dir: str | None = None) -> list[str]:
    """INPUT is a Parquet file, a directory of Parquet files (sorted by name; in Hive partition
    folders too) or a glob. A glob leaves out the files a job writes in output_dir
    ('data/*/*.parquet' into data/out matches data/out/part-00000.parquet once the job has
    written it); a directory leaves out output_dir if it is one of its folders."""
    if os.path.isfile(spec):
        return [spec]
    if os.path.isdir(spec):
        return _directory_files(spec, output_dir)
    found = glob.glob(spec, recursive=True)
    matches = sorted(p for p in found if os.path.isfile(p) and not _written_by_job(p, output_dir))
    if not matches:
        if any(os.path.isdir(p) for p in found):
            raise JobError(f"input {spec}: the glob matches only directories; match the files "
                           f"in them (e.g. {os.path.join(spec, '*.parquet')})")
        if found:
            raise JobError(f"input {spec}: the glob matches only the job's own output files")
        raise JobError(f"input {spec}: no such file or directory, and no file matches it as a glob")
    return matches


def _is_parquet_name(name: str) -> bool:
    """A .parquet file (any case of the suffix) that is not hidden (`_SUCCESS`, `.crc`, ...)."""
    return name.lower().endswith(".parquet") and not name.startswith((".", "_"))


def _directory_files(directory: str, output_dir: str | None = None) -> list[str]:
    """The Parquet files of `directory`: those at its top, sorted by name, or those in Hive
    partition folders (key=value, at the same depth everywhere: lang=en/part-0.parquet), sorted
    by path. Hidden folders and files (`_temporary`, `.staging`, `_SUCCESS`), output_dir and
    any other job's output folder are left out. Parquet files in any other folder (a Spark
    `x.parquet/` folder), or both at the top and in partition folders, are refused: reading
    some and leaving the others out without a word would lose their rows."""
    skip = os.path.realpath(output_dir) if output_dir is not None else None
    top: list[str] = []
    nested: list[str] = []  # paths relative to directory
    seen = {os.path.realpath(directory)}  # folders walked: a symlink loop is walked once
    for root, dirs, files in os.walk(directory, followlinks=True):
        dirs[:] = sorted(d for d in dirs if _is_data_folder(d)
                         and os.path.realpath(os.path.join(root, d)) not in (seen | {skip})
                         and not _is_job_output(os.path.join(root, d)))
        seen.update(os.path.realpath(os.path.join(root, d)) for d in dirs)
        rel = os.path.relpath(root, directory)
        for name in sorted(n for n in files if _is_parquet_name(n)):
            (top if rel == "." else nested).append(name if rel == "." else
                                                   os.path.join(rel, name))
    nested.sort()
    if nested:
        problem = _not_hive(nested, top)
        if problem is not None:
            raise JobError(f"input directory {directory} has Parquet files in subfolders "
                           f"({problem}); a directory INPUT reads the files at its top, or "
                           f"those in Hive partition folders (key=value, the same keys "
                           f"everywhere): give a glob that matches every file you mean, e.g. "
                           f"'{os.path.join(directory, '**', '*.parquet')}' (a glob reads no "
                           f"values from folder names)")
        return [os.path.join(directory, n) for n in nested]
    if not top:
        raise JobError(f"input directory {directory} holds no .parquet files")
    return [os.path.join(directory, n) for n in top]


def _is_data_folder(name: str) -> bool:
    """Not a hidden folder (`.staging`, Spark's `_temporary`); as Spark reads them, a folder
    whose name starts with `_` but has a `=` is a partition (`_source=web`)."""
    return not name.startswith(".") and (not name.startswith("_") or "=" in name)


def _is_job_output(folder: str) -> bool:
    """A job's OUTPUT_DIR (its manifest beside part files or stats.parquet): an earlier job's
    output inside INPUT is not input."""
    names = os.listdir(folder)
    return MANIFEST_FILE in names and any(is_part_name(n) or n == STATS_FILE for n in names)


def _not_hive(nested: list[str], top: list[str]) -> str | None:
    """Why files in subfolders (paths relative to the INPUT directory) are not one Hive-
    partitioned dataset, or None where they are."""
    first_keys: list[str] | None = None
    for rel in nested:
        folders = rel.split(os.sep)[:-1]
        keys = [f.partition("=")[0] for f in folders]
        if not all("=" in f and f.partition("=")[0] for f in folders):
            return f"{rel}: a folder not named key=value"
        if first_keys is None:
            first_keys = keys
        elif keys != first_keys:
            return (f"{rel}: partition keys {'/'.join(keys)}, where {nested[0]} has "
                    f"{'/'.join(first_keys)}")
    if top:
        return f"{nested[0]}, as well as {top[0]} at its top"
    return None


def hive_partitions(path: str, directory: str) -> tuple[tuple[str, str | None], ...]:
    """(key, value) of each key=value folder between `directory` and `path`, values
    percent-decoded as Hive and Spark write them (__HIVE_DEFAULT_PARTITION__: None)."""
    folders = os.path.relpath(path, directory).split(os.sep)[:-1]
    pairs = []
    for folder in folders:
        key, _, value = folder.partition("=")
        decoded = urllib.parse.unquote(value)
        pairs.append((urllib.parse.unquote(key),
                      None if decoded == "__HIVE_DEFAULT_PARTITION__" else decoded))
    return tuple(pairs)


def _written_by_job(path: str, output_dir: str | None) -> bool:
    name = os.path.basename(path)
    return (output_dir is not None and (is_part_name(name) or name == STATS_FILE)
            and os.path.realpath(os.path.dirname(path)) == os.path.realpath(output_dir))


def open_inputs(config: JobConfig) -> tuple[list[InputFile], pa.Schema, bool]:
    """Read every file's footer and check its schema (cheap: no row data is read)."""
    files: list[InputFile] = []
    first_schema: pa.Schema | None = None
    has_id = False
    directory = config.input if os.path.isdir(config.input) else None
    for path in resolve_input(config.input, config.output_dir):
        try:
            meta = pq.ParquetFile(path).metadata
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: a name not UTF-8
            raise JobError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
        partitions = hive_partitions(path, directory) if directory is not None else ()
        if first_schema is None:
            first_schema = schema
            has_id = check_input_schema(_with_partitions(schema, partitions, path, config), path,
                                        config)
        elif (difference := schema_difference(schema, first_schema)) is not None:
            raise JobError(f"{path}: its schema differs from {files[0].path}'s: {difference}; "
                           f"every input file must have the same columns and types")
        stat = os.stat(path)
        groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        order = tuple(first_schema.names) if schema.names != first_schema.names else ()
        id_prefix = (os.path.splitext(os.path.relpath(path, directory))[0].replace(os.sep, "/")
                     if partitions and directory is not None else "")
        files.append(InputFile(path, stat.st_size, stat.st_mtime_ns, meta.num_rows, groups,
                               footer=footer_digest(path), columns=order, partitions=partitions,
                               id_prefix=id_prefix))
    assert first_schema is not None
    if not has_id:
        _check_stems_unique(files, config.id_column)
    return (files, _with_partitions(first_schema, files[0].partitions, files[0].path, config),
            has_id)


def _with_partitions(schema: pa.Schema, partitions: tuple[tuple[str, str | None], ...],
                     path: str, config: JobConfig) -> pa.Schema:
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
                                   f"{row} and {f.path} row {offset + i}; ids must be unique")
                first_seen[value] = (f.path, offset + i)


def _check_stems_unique(files: list[InputFile], id_column: str) -> None:
    seen: dict[str, str] = {}
    for f in files:
        if f.stem in seen:
            raise JobError(f"no {id_column!r} column, and ids made from file names would repeat: "
                           f"{seen[f.stem]} and {f.path}; add an id column (see --id-column)")
        seen[f.stem] = f.path


