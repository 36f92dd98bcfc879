"""Finding a job's input files: INPUT is a Parquet file, a directory of them (at its top, or in
Hive partition folders such as lang=en/part-0.parquet), or a glob. Also the names a job writes
in its OUTPUT_DIR, which are never input.

Names and folders are looked at here, and whether a folder is a job's OUTPUT_DIR (its
manifest.json, or its stats.parquet's columns); pipeline.sources reads the files' footers.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import urllib.parse
from typing import NamedTuple, NoReturn

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import JobError
from pipeline.stats import STATS_FILE

MANIFEST_FILE = "manifest.json"  # a job's, beside its part files (pipeline.manifest)
SUCCESS_FILE = "_SUCCESS"  # a job's, once every shard is committed
_PART_NAME = re.compile(r"part-\d{5,}\.parquet")
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"

Partitions = tuple[tuple[str, str | None], ...]  # (key, value) per partition folder, in order


class Found(NamedTuple):
    """One input file as INPUT gives it."""

    path: str  # as found from INPUT (relative paths stay relative, for readable messages)
    # Hive partition values of the folders between a directory INPUT and the file (None for
    # __HIVE_DEFAULT_PARTITION__), percent-decoded as Spark and pyarrow write them
    partitions: Partitions = ()
    # the file's path under a directory INPUT without its suffix (lang=en/part-0), for files in
    # partition folders, whose names repeat from folder to folder: the prefix of generated ids
    id_prefix: str = ""


def part_name(shard_id: int) -> str:
    return f"part-{shard_id:05d}.parquet"


def is_part_name(name: str) -> bool:
    """Whether `name` is a part file's (part-00000.parquet, part-123456.parquet)."""
    return _PART_NAME.fullmatch(name) is not None


def discover_inputs(spec: str, output_dir: str | None = None) -> list[Found]:
    """INPUT's files: a Parquet file; a directory's (see _directory_files); or a glob's matches,
    sorted, without the files a job writes in output_dir ('data/*/*.parquet' into data/out
    matches data/out/part-00000.parquet once the job has written it). A glob reads no values
    from folder names."""
    found = _discover(spec, output_dir)
    for f in found:
        try:
            f.path.encode("utf-8")
        except UnicodeEncodeError:
            raise JobError(f"input {f.path!r}: the file's name is not UTF-8 (Parquet readers take "
                           "UTF-8 paths); rename it") from None
    return found


def _discover(spec: str, output_dir: str | None) -> list[Found]:
    if os.path.isfile(spec):
        return [Found(spec)]
    if os.path.isdir(spec):
        return _directory_files(spec)
    if os.path.lexists(spec):
        raise JobError(f"input {spec}: {_not_regular(spec)}")
    found = glob.glob(spec, recursive=True)
    files = sorted(p for p in found if os.path.isfile(p) and not _written_by_job(p, output_dir))
    spelled = _spelled(spec)
    # a job's folder matters only for a match other than a part file: list only those folders
    folders = {os.path.dirname(p) for p in files if not is_part_name(os.path.basename(p))}
    job_folders = {f for f in folders if _is_job_output(f, os.listdir(f or "."))}
    hidden: list[str] = []  # matched, but not data
    data: list[str] = []
    for path in files:
        (hidden if _not_data(path, spelled, job_folders) else data).append(path)
    matches = _one_path_per_file(spec, data)
    if not matches:
        if hidden:
            raise JobError(f"input {spec}: the glob matches only files that are not data "
                           f"({hidden[0]}: {_NOT_DATA}); spell the name out in the glob to read "
                           f"it")
        if any(os.path.isdir(p) for p in found):
            raise JobError(f"input {spec}: the glob matches only directories; match the files "
                           f"in them (e.g. {os.path.join(spec, '*.parquet')})")
        special = [p for p in found if not os.path.isfile(p)]
        if special:
            raise JobError(f"input {spec}: the glob matches only {special[0]}: "
                           f"{_not_regular(special[0])}")
        if found:
            raise JobError(f"input {spec}: the glob matches only the job's own output files")
        raise JobError(f"input {spec}: no such file or directory, and no file matches it as a glob")
    if hidden:
        print(f"note: input {spec}: left out {len(hidden)} file(s) the glob's wildcards matched "
              f"that are not data, such as {hidden[0]} ({_NOT_DATA}; spell the name out in the "
              f"glob to read it)", file=sys.stderr)
    left_out = _folders_left_out(found, files, spelled, output_dir)
    datasets = [p for p in left_out if p.rstrip(os.sep).endswith(".parquet")]
    if datasets:  # a folder of part files, as Spark and pyarrow write a dataset
        raise JobError(f"input {spec}: the glob matches the directory {datasets[0]}, none of "
                       f"whose files it matches (a glob reads files): give the directory as "
                       f"INPUT, or a glob that matches its files too (e.g. "
                       f"{os.path.join(os.path.dirname(spec), '**', '*.parquet')})")
    if left_out:
        print(f"note: input {spec}: left out {len(left_out)} directory(ies) the glob matched, "
              f"such as {left_out[0]} (a glob reads files: match the files in them to read "
              "them)", file=sys.stderr)
    stems = [os.path.splitext(os.path.basename(p))[0] for p in matches]
    if len(set(stems)) == len(stems):
        return [Found(p) for p in matches]  # ids made from the file names, as always
    # files of one name in several folders ('data/*/part-0.parquet'): ids made from their paths
    # under the glob's fixed folders, as a directory INPUT's ('lang=en/part-0:0')
    base = _fixed_folders(spec)
    return [Found(p, (), os.path.splitext(os.path.relpath(p, base))[0].replace(os.sep, "/"))
            for p in matches]


def _not_regular(path: str) -> str:
    if not os.path.exists(path):
        return "a broken symbolic link"
    return "not a regular file or a directory (a device, a pipe or a socket)"


def _folders_left_out(found: list[str], files: list[str], spelled: set[str],
                      output_dir: str | None) -> list[str]:
    """The directories a glob matched that hold a data file (hidden names aside) and none of
    whose files it matched: their rows would be left out without a word. A job's OUTPUT_DIR is
    not one of them."""
    covered = set()  # every folder above a matched file
    for path in files:
        folder = os.path.dirname(path)
        while folder and folder not in covered:
            covered.add(folder)
            parent = os.path.dirname(folder)
            folder = "" if parent == folder else parent
    out = os.path.abspath(output_dir) if output_dir else None
    return [p for p in found if os.path.isdir(p) and p.rstrip(os.sep) not in covered
            and os.path.abspath(p) != out and not _hidden_by_wildcard(p.rstrip(os.sep), spelled)
            and not _is_job_output(p, os.listdir(p)) and _holds_data(p)]


def _holds_data(folder: str) -> bool:
    """Whether a file that is not hidden ('_x', '.x' anywhere below `folder`) lies under it."""
    for _, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not _hidden(d)]
        if any(not _hidden(n) for n in names):
            return True
    return False


def _one_path_per_file(spec: str, paths: list[str]) -> list[str]:
    """`paths` (sorted) with each file once, by its shortest path: a '**' glob follows symlinked
    folders, a loop back up too, and matched one file 41 times (each with ids of its own)."""
    shortest: dict[str, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real not in shortest or (path.count(os.sep), path) < (
                shortest[real].count(os.sep), shortest[real]):
            shortest[real] = path
    kept = set(shortest.values())
    if dropped := [p for p in paths if p not in kept]:
        same = shortest[os.path.realpath(dropped[0])]
        print(f"note: input {spec}: left out {len(dropped)} match(es) of files the glob matched "
              f"by another path too, such as {dropped[0]} (the same file as {same})",
              file=sys.stderr)
    return [p for p in paths if p in kept]


def _fixed_folders(spec: str) -> str:
    """The folders a glob names before its first wildcard ('data/hive' of
    'data/hive/*/part-0.parquet'; '.' where it starts with one)."""
    fixed = []
    for part in spec.split(os.sep)[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return os.sep.join(fixed) or (os.sep if spec.startswith(os.sep) else ".")


_NOT_DATA = ("a file or folder named '_x' or '.x', such as Spark's _temporary, or a job's "
             "file other than its part files, such as its stats.parquet")


def _not_data(path: str, spelled: set[str], job_folders: set[str]) -> bool:
    """Whether a wildcard of a glob (which spells out the names `spelled`) matched a name on
    `path` that is not data: a hidden one (_hidden_by_wildcard) or, in a job's OUTPUT_DIR, a
    file other than its part files ('out/*' or 'out/*.parquet': its stats.parquet,
    manifest.json, report.md and plots; its part files are its rows)."""
    name = os.path.basename(path)
    return _hidden_by_wildcard(path, spelled) or (
        not is_part_name(name) and name not in spelled
        and os.path.dirname(path) in job_folders)


def _spelled(spec: str) -> set[str]:
    """The names a glob spells out, without wildcards."""
    return {part for part in spec.split(os.sep) if not glob.has_magic(part)}


def _hidden(name: str) -> bool:
    """A name such as Spark's `_temporary`, `_SUCCESS` or a `.crc` file: not data."""
    return name.startswith((".", "_"))


def _hidden_by_wildcard(path: str, spelled: set[str]) -> bool:
    """Whether a wildcard of a glob matched a hidden name on `path`: a file or folder left out
    of a directory INPUT (see _directory_files), such as the attempt files under a Spark job's
    `_temporary/` folder that 'data/**/*.parquet' matches. A name the glob spells out (in
    `spelled`: 'data/_staging/*.parquet') is meant."""
    *folders, name = path.split(os.sep)
    return ((_hidden(name) and name not in spelled)
            or any(not _is_data_folder(f) and f not in spelled for f in folders
                   if f not in ("", ".", "..")))


def _is_job_output(folder: str, names: list[str]) -> bool:
    """Whether `folder`, holding files of these names, is a job's OUTPUT_DIR: its manifest
    beside part files or stats.parquet (the job writes both before its first shard); or,
    finished, its _SUCCESS beside both, where the manifest was deleted (Spark writes _SUCCESS
    beside part files named part-00000-<uuid>...parquet, and no stats.parquet). The names are
    not enough: a user's folder may hold a manifest.json and a stats.parquet of its own, so
    the manifest must not be JSON of another kind, and a stats.parquet alone must have a job's
    columns."""
    if MANIFEST_FILE in names:
        return (any(is_part_name(n) or n == STATS_FILE for n in names)
                and _our_manifest(os.path.join(folder, MANIFEST_FILE)))
    return (SUCCESS_FILE in names and STATS_FILE in names and any(map(is_part_name, names))
            and _our_stats(os.path.join(folder, STATS_FILE)))


def _our_manifest(path: str) -> bool:
    """Whether it is a job's: an object with its config and shard count, or a file that is
    not JSON at all (a damaged one is still the job's; resuming it names the damage)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return True
    return isinstance(data, dict) and {"config", "num_shards"} <= data.keys()


def _our_stats(path: str) -> bool:
    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowInvalid):
        return False
    return {"shard_id", "committed_at", "output_tokens_per_s"} <= set(names)


def _directory_files(directory: str) -> list[Found]:
    """The Parquet files of `directory`: those at its top, sorted by name, or those in Hive
    partition folders (key=value, the same keys at the same depth everywhere), sorted by path.
    Left out: hidden files and folders (`.x`; `_x` without a `=`, such as Spark's `_temporary`
    and `_SUCCESS`), any job's output folder below it (a rerun's own OUTPUT_DIR among them), and
    where `directory` is a job's output, its stats.parquet (its part files are its rows).
    Symlinked folders are followed (a loop back to a folder above is cut). Parquet files in any
    other folder (a Spark `x.parquet/` folder), or both at the top and in partition folders,
    are refused: reading some and leaving the others out without a word would lose their
    rows; so is a folder that cannot be listed."""
    top: list[str] = []
    nested: list[str] = []  # paths relative to directory
    above = {directory: {os.path.realpath(directory)}}  # per folder walked: it and its parents
    for root, dirs, files in os.walk(directory, onerror=_unlistable, followlinks=True):
        rel = os.path.relpath(root, directory)
        job_output = _is_job_output(root, files)
        if job_output and rel != ".":  # another job's outputs: not input, nor what is below
            dirs[:] = []
            continue
        if job_output and SUCCESS_FILE not in files:
            raise JobError(f"input directory {directory} is the OUTPUT_DIR of a job that has not "
                           f"finished (no {SUCCESS_FILE}): rows of its unfinished shards would "
                           f"be missing; finish that job (rerun its command), or give the part "
                           f"files written so far as a glob, "
                           f"'{os.path.join(directory, 'part-*.parquet')}'")
        kept = []
        for name in sorted(dirs):
            path = os.path.join(root, name)
            real = os.path.realpath(path)
            if _is_data_folder(name) and real not in above[root]:
                above[path] = above[root] | {real}
                kept.append(name)
        dirs[:] = kept
        for name in sorted(n for n in files if _is_parquet_name(n)):
            if rel != ".":
                nested.append(os.path.join(rel, name))
            elif not (job_output and name == STATS_FILE):
                top.append(name)
    if not nested:
        if not top:
            raise JobError(f"input directory {directory} holds no .parquet files")
        return [Found(os.path.join(directory, n)) for n in top]
    nested.sort()
    parsed = [_partition_folders(rel) for rel in nested]
    problem = _not_hive(nested, parsed, top)
    if problem is not None:
        raise JobError(f"input directory {directory} has Parquet files in subfolders "
                       f"({problem}); a directory INPUT reads the files at its top, or "
                       f"those in Hive partition folders (key=value, the same keys "
                       f"everywhere): give a glob that matches every file you mean, e.g. "
                       f"'{os.path.join(directory, '**', '*.parquet')}' (a glob reads no "
                       f"values from folder names)")
    return [Found(os.path.join(directory, rel), tuple(pairs or ()),
                  os.path.splitext(rel)[0].replace(os.sep, "/"))
            for rel, pairs in zip(nested, parsed, strict=True)]


def _partition_folders(rel: str) -> list[tuple[str, str | None]] | None:
    """The (key, value) of each folder of `rel` (a file's path under INPUT), decoded; None
    where a folder is not named key=value. A percent-escape that does not decode to UTF-8
    (lang=%FF) is refused, as pyarrow refuses it: two such folders would get one value."""
    pairs: list[tuple[str, str | None]] = []
    for folder in rel.split(os.sep)[:-1]:
        key, eq, value = folder.partition("=")
        if not eq or not key:
            return None
        try:
            key, value = (urllib.parse.unquote(part, errors="strict") for part in (key, value))
        except UnicodeDecodeError:
            raise JobError(f"partition folder {folder} (in {rel}): its percent-escapes are not "
                           f"UTF-8 once decoded") from None
        pairs.append((key, None if value == _HIVE_NULL else value))
    return pairs


def _not_hive(nested: list[str], parsed: list[list[tuple[str, str | None]] | None],
              top: list[str]) -> str | None:
    """Why the files in subfolders (paths under INPUT, and their folders' partitions) are not
    one Hive-partitioned dataset, or None where they are."""
    first_keys: list[str] | None = None
    for rel, pairs in zip(nested, parsed, strict=True):
        if pairs is None:
            return f"{rel}: a folder not named key=value"
        keys = [key for key, _ in pairs]
        if first_keys is None:
            first_keys = keys
        elif keys != first_keys:
            return (f"{rel}: partition keys {'/'.join(keys)}, where {nested[0]} has "
                    f"{'/'.join(first_keys)}")
    if top:
        return f"{nested[0]}, as well as {top[0]} at its top"
    return None


def _is_parquet_name(name: str) -> bool:
    """A .parquet file (any case of the suffix) that is not hidden (`_SUCCESS`, `.crc`, ...)."""
    return name.lower().endswith(".parquet") and not _hidden(name)


def _is_data_folder(name: str) -> bool:
    """Not a hidden folder (`.staging`, Spark's `_temporary`); as Spark reads them, a folder
    whose name starts with `_` but has a `=` is a partition (`_source=web`)."""
    return not name.startswith(".") and (not name.startswith("_") or "=" in name)


def _written_by_job(path: str, output_dir: str | None) -> bool:
    name = os.path.basename(path)
    return (output_dir is not None and (is_part_name(name) or name == STATS_FILE)
            and os.path.realpath(os.path.dirname(path)) == os.path.realpath(output_dir))


def _unlistable(exc: OSError) -> NoReturn:
    """os.walk's onerror: a folder of INPUT that cannot be listed stops the job, named (its
    files would be left out without a word)."""
    raise JobError(f"input folder {exc.filename}: cannot be listed "
                   f"({exc.strerror or exc})") from None
