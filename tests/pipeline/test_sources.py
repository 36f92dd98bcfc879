"""Input discovery, up-front validation and shard planning, on real Parquet files."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.discover as discover
from pipeline.config import JobConfig, JobError
from pipeline.discover import discover_inputs
from pipeline.job import run_job
from pipeline.sources import open_inputs, plan_inputs, plan_shards, scan_inputs
from runtime.config import EngineConfig
from runtime.engine import Engine
from tests.pipeline.helpers import corrupt_page, read_parts, write_parquet


def resolve_input(spec: str, output_dir: str | None = None) -> list[str]:
    """The paths discover_inputs finds."""
    return [found.path for found in discover_inputs(spec, output_dir)]


def _config(input_path: Path | str, **kw: object) -> JobConfig:
    return JobConfig(input=str(input_path), output_dir="unused", **kw)  # type: ignore[arg-type]


def _prompts(n: int, start: int = 0) -> dict[str, list]:
    return {"id": [f"r{i}" for i in range(start, start + n)],
            "prompt": [f"prompt {i}" for i in range(start, start + n)]}


def test_directory_lists_parquet_files_sorted_skipping_hidden_and_underscore(
        tmp_path: Path) -> None:
    for name in ("b.parquet", "a.parquet", "C.PARQUET", "_meta.parquet", ".tmp.parquet"):
        write_parquet(tmp_path / name, _prompts(1))
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".hidden").mkdir()  # a hidden folder's files are not rows of the input
    write_parquet(tmp_path / ".hidden" / "x.parquet", _prompts(1))
    (tmp_path / "empty-folder").mkdir()
    assert resolve_input(str(tmp_path)) == [str(tmp_path / "C.PARQUET"),
                                            str(tmp_path / "a.parquet"),
                                            str(tmp_path / "b.parquet")]


@pytest.mark.parametrize(("nested", "top", "problem"), [
    ("sub/deep.parquet", True, "sub/deep.parquet: a folder not named key=value"),
    ("x.parquet/part-0.parquet", True,  # a Spark-style folder
     "x.parquet/part-0.parquet: a folder not named key=value"),
    ("lang=en/part-0.parquet", True, "lang=en/part-0.parquet, as well as top.parquet at its top"),
    ("lang=en/x=1/part-0.parquet", False,
     "lang=en/x=1/part-0.parquet: partition keys lang/x, where lang=en/a.parquet has lang"),
])
def test_a_directory_with_parquet_files_in_other_subfolders_is_refused(
        tmp_path: Path, nested: str, top: bool, problem: str) -> None:
    """Before, their rows were left out without a word (or, for a folder named x.parquet,
    'not a readable Parquet file')."""
    if top:
        write_parquet(tmp_path / "top.parquet", _prompts(1))
    else:
        write_parquet(tmp_path / "lang=en" / "a.parquet", _prompts(1))
    write_parquet(tmp_path / nested, _prompts(1))
    with pytest.raises(JobError) as raised:
        resolve_input(str(tmp_path))
    assert str(raised.value) == (
        f"input directory {tmp_path} has Parquet files in subfolders ({problem}); a directory "
        f"INPUT reads the files at its top, or those in Hive partition folders (key=value, the "
        f"same keys everywhere): give a glob that matches every file you mean, e.g. "
        f"'{tmp_path}/**/*.parquet' (a glob reads no values from folder names)")
    assert str(tmp_path / nested) in resolve_input(f"{tmp_path}/**/*.parquet")


def test_a_directory_of_hive_partitions_reads_their_files_and_values(tmp_path: Path) -> None:
    for folder, n in (("lang=fr", 2), ("lang=en", 1), ("lang=a%2Fb", 1),
                      ("lang=__HIVE_DEFAULT_PARTITION__", 1)):
        write_parquet(tmp_path / folder / "part-0.parquet",
                      {"prompt": [f"{folder} {i}" for i in range(n)]})
    write_parquet(tmp_path / "_temporary" / "lang=xx" / "part-0.parquet", {"prompt": ["x"]})
    write_parquet(tmp_path / ".staging" / "lang=yy" / "part-0.parquet", {"prompt": ["x"]})
    (tmp_path / "lang=en" / "_SUCCESS").write_text("")
    files, schema, has_id = open_inputs(_config(tmp_path))
    assert not has_id and schema.names == ["prompt", "lang"]
    assert [(f.path, f.partitions, f.id_stem) for f in files] == [
        (str(tmp_path / "lang=__HIVE_DEFAULT_PARTITION__" / "part-0.parquet"), (("lang", None),),
         "lang=__HIVE_DEFAULT_PARTITION__/part-0"),
        (str(tmp_path / "lang=a%2Fb" / "part-0.parquet"), (("lang", "a/b"),),
         "lang=a%2Fb/part-0"),
        (str(tmp_path / "lang=en" / "part-0.parquet"), (("lang", "en"),), "lang=en/part-0"),
        (str(tmp_path / "lang=fr" / "part-0.parquet"), (("lang", "fr"),), "lang=fr/part-0")]
    clash = write_parquet(tmp_path / "clash" / "lang=en" / "part-0.parquet",
                          {"prompt": ["p"], "lang": ["en"]})
    with pytest.raises(JobError, match=re.escape(
            f"{clash}: partition folder lang=... names a column the file has; rename the folder "
            f"or the column")):
        open_inputs(_config(tmp_path / "clash"))


@pytest.mark.parametrize(("key", "what", "kw"), [
    ("id", "the id column (--id-column)", {}),
    ("key", "the id column (--id-column)", {"id_column": "key"}),
    ("text", "the prompt column (--prompt-column)", {"prompt_column": "text"}),
    ("max_tokens", "a per-row max_tokens", {}),
])
def test_a_partition_key_the_job_reads_as_a_column_is_refused(
        tmp_path: Path, key: str, what: str, kw: dict[str, str]) -> None:
    """Before, an id=1/ folder was taken for the id column and the scan failed with a KeyError
    traceback; a max_tokens=8/ folder was called a string column of the file."""
    column = "prompt" if key != "text" else "other"
    path = write_parquet(tmp_path / f"{key}=1" / "a.parquet", {column: ["p"]})
    write_parquet(tmp_path / f"{key}=2" / "a.parquet", {column: ["q"]})
    with pytest.raises(JobError) as raised:
        plan_inputs(_config(tmp_path, **kw))
    assert str(raised.value) == (
        f"{path}: partition folder {key}=... names {what}, which is read from the files' own "
        f"columns, not from folder names (whose values are strings); rename the folder")


def test_partition_folders_under_a_symlink_or_named_with_an_underscore_and_a_key_are_read(
        tmp_path: Path) -> None:
    """os.walk does not enter a symlinked folder: its rows were left out without a word. A
    folder such as _source=web is a partition (as Spark reads it), not a hidden folder."""
    data = tmp_path / "data"
    write_parquet(data / "lang=en" / "a.parquet", {"prompt": ["p"]})
    write_parquet(tmp_path / "elsewhere" / "lang=de" / "a.parquet", {"prompt": ["q"]})
    (data / "lang=de").symlink_to(tmp_path / "elsewhere" / "lang=de")
    (data / "lang=fr").symlink_to(tmp_path / "elsewhere" / "lang=de")  # read again, as named
    (data / "lang=en" / "loop").symlink_to(data)  # a loop back up is cut, not walked forever
    assert resolve_input(str(data)) == [str(data / "lang=de" / "a.parquet"),
                                        str(data / "lang=en" / "a.parquet"),
                                        str(data / "lang=fr" / "a.parquet")]
    deep = tmp_path / "deep"  # a link to a folder walked elsewhere, one level down: read too
    write_parquet(deep / "a=1" / "b=1" / "x.parquet", {"prompt": ["p"]})
    (deep / "a=2").mkdir()
    (deep / "a=2" / "b=1").symlink_to(deep / "a=1" / "b=1")
    assert resolve_input(str(deep)) == [str(deep / "a=1" / "b=1" / "x.parquet"),
                                        str(deep / "a=2" / "b=1" / "x.parquet")]
    flat = tmp_path / "flat"
    write_parquet(flat / "a.parquet", {"prompt": ["p"]})
    (flat / "more").symlink_to(tmp_path / "elsewhere")  # not named key=value: refused, as before
    with pytest.raises(JobError, match=re.escape("(more/lang=de/a.parquet: a folder not named")):
        resolve_input(str(flat))
    under = tmp_path / "under"
    write_parquet(under / "_source=web" / "a.parquet", {"prompt": ["p"]})
    files, schema, _ = open_inputs(_config(under))
    assert schema.names == ["prompt", "_source"]
    assert files[0].partitions == (("_source", "web"),)


def test_output_dirs_inside_a_directory_input(tmp_path: Path, tiny_model_dir: Path,
                                            tiny_engine: Engine) -> None:
    """A folder of INPUT holding another job's outputs is not input (nor is stats.parquet of
    a job's OUTPUT_DIR given as INPUT: its part files are its rows); a folder that is only
    named OUTPUT_DIR, with Parquet files but no job's, is input and refused as such (it was
    left out without a word)."""
    data = tmp_path / "data"
    write_parquet(data / "a.parquet", _prompts(2))
    write_parquet(data / "more" / "b.parquet", _prompts(1, start=2))
    with pytest.raises(JobError, match=re.escape("(more/b.parquet: a folder not named key=value")):
        resolve_input(str(data), str(data / "more"))
    (data / "more" / "b.parquet").unlink()
    config = JobConfig(input=str(data), output_dir=str(data / "more"), shard_rows=1,
                       max_tokens=2, engine=EngineConfig(model=str(tiny_model_dir)))
    run_job(config, lambda _: tiny_engine, progress=False)
    assert resolve_input(str(data)) == [str(data / "a.parquet")]
    assert resolve_input(str(data / "more")) == [str(data / "more" / "part-00000.parquet"),
                                                 str(data / "more" / "part-00001.parquet")]


def test_a_partition_value_whose_escapes_are_not_utf8_is_refused(tmp_path: Path) -> None:
    """lang=%FF decoded to U+FFFD without a word (two such folders, one value)."""
    write_parquet(tmp_path / "lang=%FF" / "a.parquet", _prompts(1))
    with pytest.raises(JobError, match=re.escape(
            f"partition folder lang=%FF (in lang=%FF{os.sep}a.parquet): its percent-escapes are "
            f"not UTF-8 once decoded")):
        resolve_input(str(tmp_path))


def test_a_folder_that_cannot_be_listed_is_named(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    write_parquet(tmp_path / "lang=en" / "a.parquet", _prompts(1))
    real = os.scandir

    def scandir(path: Any) -> Any:
        if str(path).endswith("lang=en"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(discover.os, "scandir", scandir)  # what os.walk lists folders with
    with pytest.raises(JobError, match=re.escape(
            f"input folder {tmp_path}/lang=en: cannot be listed (Permission denied)")):
        resolve_input(str(tmp_path))


def test_a_glob_leaves_out_the_hidden_names_its_wildcards_match(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a Spark job's output while it runs: committed part files, attempt files in _temporary
    data = tmp_path / "data"
    for rel in ("part-0.parquet", "_src=web/part-1.parquet", "_meta.parquet",
                "_temporary/0/_temporary/attempt_1/part-2.parquet"):
        write_parquet(data / rel, _prompts(1))
    assert resolve_input(f"{data}/**/*.parquet") == [str(data / "_src=web" / "part-1.parquet"),
                                                     str(data / "part-0.parquet")]
    assert capsys.readouterr().err == (
        f"note: input {data}/**/*.parquet: left out 2 file(s) the glob's wildcards matched "
        f"that are not data, such as {data}/_meta.parquet (a file or folder named '_x' or '.x', "
        f"such as Spark's _temporary, or a job's file other than its part files, such as its "
        f"stats.parquet; spell the name out in the glob to read it)\n")
    # a name the glob spells out is meant, in INPUT's own path too
    assert resolve_input(f"{data}/_temporary/*/_temporary/*/*.parquet") == [
        str(data / "_temporary/0/_temporary/attempt_1/part-2.parquet")]
    assert resolve_input(f"{data}/_meta.parquet") == [str(data / "_meta.parquet")]
    assert capsys.readouterr().err == ""
    with pytest.raises(JobError) as raised:
        resolve_input(f"{data}/*/0/*/*/*.parquet")
    assert str(raised.value) == (
        f"input {data}/*/0/*/*/*.parquet: the glob matches only files that are not data "
        f"({data}/_temporary/0/_temporary/attempt_1/part-2.parquet: a file or folder named '_x' "
        f"or '.x', such as Spark's _temporary, or a job's file other than its part files, "
        f"such as its stats.parquet); spell the name out in the glob to read it")


def test_a_glob_that_matches_a_folder_but_none_of_its_files_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dataset folder named like a file (Spark's and pyarrow's ds.parquet/) that a glob
    matches without its files is refused, naming it: its rows would be left out. Another such
    folder is left out with a note; a glob that reaches the folder's files is quiet."""
    data = tmp_path / "data"
    write_parquet(data / "ds.parquet" / "part-0000.parquet", _prompts(2))
    write_parquet(data / "other.parquet", _prompts(1))
    write_parquet(data / "sub" / "x.parquet", _prompts(1))
    for spec in (f"{data}/*.parquet", f"{data}/*"):
        with pytest.raises(JobError) as raised:
            resolve_input(spec)
        assert str(raised.value) == (
            f"input {spec}: the glob matches the directory {data}/ds.parquet, none of whose "
            f"files it matches (a glob reads files): give the directory as INPUT, or a glob "
            f"that matches its files too (e.g. {data}/**/*.parquet)")
    assert resolve_input(f"{data}/**/*.parquet") == [
        str(data / "ds.parquet" / "part-0000.parquet"), str(data / "other.parquet"),
        str(data / "sub" / "x.parquet")]
    assert capsys.readouterr().err == ""
    (data / "ds.parquet" / "part-0000.parquet").rename(data / "part-0000.parquet")
    (data / "ds.parquet").rmdir()
    assert resolve_input(f"{data}/*") == [str(data / "other.parquet"),
                                          str(data / "part-0000.parquet")]
    assert capsys.readouterr().err == (
        f"note: input {data}/*: left out 1 directory(ies) the glob matched, such as {data}/sub "
        f"(a glob reads files: match the files in them to read them)\n")
    # a folder with nothing to read (an empty dataset's _SUCCESS), and the job's own OUTPUT_DIR
    # (a job reading data/* into data/out), are left out without a word
    (data / "empty.parquet").mkdir()
    (data / "empty.parquet" / "_SUCCESS").write_text("")
    (data / "sub" / "x.parquet").rename(data / "x.parquet")
    write_parquet(data / "out" / "part-00000.parquet", _prompts(1))
    (data / "out" / "manifest.json").write_text("{}")
    assert resolve_input(f"{data}/*", str(data / "out")) == [
        str(data / "other.parquet"), str(data / "part-0000.parquet"), str(data / "x.parquet")]
    assert capsys.readouterr().err == ""


def test_an_input_that_is_not_a_regular_file_is_named_as_such(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.parquet")
    with pytest.raises(JobError) as raised:
        resolve_input(str(tmp_path / "pipe.parquet"))
    assert str(raised.value) == (f"input {tmp_path}/pipe.parquet: not a regular file or a "
                                 "directory (a device, a pipe or a socket)")
    with pytest.raises(JobError) as raised:
        resolve_input(f"{tmp_path}/pipe*")
    assert str(raised.value) == (f"input {tmp_path}/pipe*: the glob matches only "
                                 f"{tmp_path}/pipe.parquet: not a regular file or a directory "
                                 "(a device, a pipe or a socket)")
    (tmp_path / "gone.parquet").symlink_to(tmp_path / "nowhere.parquet")
    with pytest.raises(JobError) as raised:
        resolve_input(str(tmp_path / "gone.parquet"))
    assert str(raised.value) == f"input {tmp_path}/gone.parquet: a broken symbolic link"
    name = os.fsdecode(b"\xff.parquet")  # not UTF-8: a surrogate escape in Python
    write_parquet(tmp_path / "d" / "a.parquet", _prompts(1))
    (tmp_path / "d" / "a.parquet").rename(tmp_path / "d" / name)  # (pyarrow takes no such path)
    with pytest.raises(JobError) as raised:
        resolve_input(str(tmp_path / "d"))
    assert str(raised.value) == (f"input {str(tmp_path / 'd' / name)!r}: the file's name is not "
                                 "UTF-8 (Parquet readers take UTF-8 paths); rename it")


def test_glob_and_single_file(tmp_path: Path) -> None:
    for name in ("x2.parquet", "x1.parquet", "y.parquet"):
        write_parquet(tmp_path / name, _prompts(1))
    assert resolve_input(str(tmp_path / "x*.parquet")) == [str(tmp_path / "x1.parquet"),
                                                          str(tmp_path / "x2.parquet")]
    assert resolve_input(str(tmp_path / "y.parquet")) == [str(tmp_path / "y.parquet")]


def test_missing_input_and_empty_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="no such file or directory, and no file matches it"):
        resolve_input(str(tmp_path / "nope*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="holds no .parquet files"):
        resolve_input(str(tmp_path / "empty"))
    (tmp_path / "shards" / "a").mkdir(parents=True)
    spec = str(tmp_path / "shards" / "*")
    with pytest.raises(JobError, match=re.escape(
            f"input {spec}: the glob matches only directories; match the files in them (e.g. "
            f"{spec}/*.parquet)")):
        resolve_input(spec)
    out = tmp_path / "out"
    write_parquet(out / "part-00000.parquet", _prompts(1))
    with pytest.raises(JobError, match="the glob matches only the job's own output files$"):
        resolve_input(str(out / "*.parquet"), str(out))


def test_shards_never_span_files_and_are_numbered_globally(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", _prompts(5))
    write_parquet(tmp_path / "b.parquet", _prompts(3, start=5))
    files, _, _ = open_inputs(_config(tmp_path))
    shards = plan_shards(files, shard_rows=2)
    assert [(s.shard_id, s.file.id_stem, s.start, s.stop) for s in shards] == [
        (0, "a", 0, 2), (1, "a", 2, 4), (2, "a", 4, 5), (3, "b", 0, 2), (4, "b", 2, 3)]
    assert [s.part_name for s in shards][-1] == "part-00004.parquet"


def test_empty_file_gives_no_shards(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", {"id": pa.array([], pa.string()),
                                           "prompt": pa.array([], pa.string())})
    write_parquet(tmp_path / "b.parquet", _prompts(2))
    files, _, _ = open_inputs(_config(tmp_path))
    assert [(s.shard_id, s.file.id_stem) for s in plan_shards(files, 10)] == [(0, "b")]


def test_not_a_parquet_file_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet")
    with pytest.raises(JobError, match=rf"^{bad}: not a readable Parquet file \(.*magic bytes"):
        open_inputs(_config(bad))


def test_truncated_file_names_the_file(tmp_path: Path) -> None:
    good = write_parquet(tmp_path / "good.parquet", _prompts(100))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[:200])
    with pytest.raises(JobError, match=rf"^{cut}: not a readable Parquet file"):
        open_inputs(_config(tmp_path))


def test_a_corrupt_data_page_is_found_before_generation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its row group's rows will be error rows; the job goes on with the others."""
    path = write_parquet(tmp_path / "c.parquet", _prompts(1000), row_group_size=250)
    corrupt_page(path, group=2, column=1)  # the prompts of rows 500-749
    config = _config(path)
    files, _, has_id = open_inputs(config)  # the footer is intact
    [scanned] = scan_inputs(files, config, has_id)
    [(group, message)] = scanned.unreadable_groups
    assert group == 2 and message.startswith(f"{path}: cannot read row group 2 (rows 500-749): ")
    assert message.isprintable()
    assert capsys.readouterr().err == f"{message}; its 250 rows will be error rows\n"
    assert (scanned.path, scanned.size, scanned.row_group_rows) == (
        files[0].path, files[0].size, files[0].row_group_rows)


def test_a_page_whose_checksum_fails_is_an_unreadable_row_group(tmp_path: Path) -> None:
    """A file written with page checksums and one byte of a prompt changed since: pyarrow reads
    the changed text unless asked to check; before, the job generated from 'PROMPT_9'."""
    path = tmp_path / "crc.parquet"
    pq.write_table(pa.table({"id": list(range(6)), "prompt": [f"PROMPT_{i}" for i in range(6)]}),
                   path, compression="none", use_dictionary=False, write_page_checksum=True,
                   row_group_size=3)
    data = bytearray(path.read_bytes())
    data[data.find(b"PROMPT_4") + 7] = ord("9")
    path.write_bytes(bytes(data))
    assert pq.read_table(path).column("prompt")[4].as_py() == "PROMPT_9"  # unchecked
    config = _config(path)
    files, _, has_id = open_inputs(config)
    [scanned] = scan_inputs(files, config, has_id)
    [(group, message)] = scanned.unreadable_groups
    assert group == 1 and message.startswith(f"{path}: cannot read row group 1 (rows 3-5): ")
    assert "CRC" in message


def test_a_corrupt_page_of_the_ids_stops_the_job_before_generation(tmp_path: Path) -> None:
    """Rows without their ids could not be written as the rows they are."""
    path = write_parquet(tmp_path / "c.parquet", _prompts(1000), row_group_size=250)
    corrupt_page(path, group=1, column=0)
    config = _config(path)
    files, _, has_id = open_inputs(config)
    with pytest.raises(JobError, match=rf"^{path}: cannot read row group 1 \(rows 250-499\): "
                                       r".*, its id column 'id' included$"):
        scan_inputs(files, config, has_id)


@pytest.mark.parametrize(("columns", "kw", "message"), [
    ({"id": ["a"], "text": ["hi"]}, {},
     "no column 'prompt' (columns: id, text); choose the column with --prompt-column"),
    ({"id": ["a"], "prompt": [1]}, {},
     "column 'prompt' is int64, expected string (--prompt-column)"),
    ({"id": ["a"], "msgs": [["hi"]]}, {"messages_column": "msgs"},
     "column 'msgs' is list<element: string>, expected list<struct<role: string, content: string>> "
     "(--messages-column)"),
    ({"id": [1.5], "prompt": ["hi"]}, {},
     "id column 'id' is double; ids must be strings or integers (see --id-column)"),
    ({"id": ["a"], "prompt": ["hi"], "temperature": ["hot"]}, {},
     "column 'temperature' overrides the temperature option per row and must be a number, "
     "but it is string"),
    ({"id": ["a"], "prompt": ["hi"], "stop": ["."]}, {},
     "column 'stop' overrides the stop option per row and must be list<string>, but it is string"),
    ({"id": ["a"], "prompt": ["hi"], "completion": ["old"]}, {},
     "input column 'completion' has the name of an output column; rename it"),
])
def test_bad_schema_names_file_and_column(tmp_path: Path, columns: dict, kw: dict,
                                          message: str) -> None:
    path = write_parquet(tmp_path / "in.parquet", columns)
    with pytest.raises(JobError) as err:
        open_inputs(_config(path, **kw))
    assert str(err.value).startswith(f"{path}: {message}")


def test_messages_column_type_is_accepted(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {
        "id": ["a"], "msgs": [[{"role": "user", "content": "hi", "name": "x"}]]})
    _, schema, has_id = open_inputs(_config(path, messages_column="msgs"))
    assert has_id and schema.names == ["id", "msgs"]
    # forgotten, the option is named with the column
    with pytest.raises(JobError) as err:
        open_inputs(_config(path))
    assert str(err.value) == (f"{path}: no column 'prompt' (columns: id, msgs); choose the "
                              "column with --prompt-column, or give the chat column 'msgs' "
                              "with --messages-column")


def test_a_users_folder_with_a_manifest_and_stats_of_its_own_is_read(tmp_path: Path) -> None:
    """A folder holding a manifest.json that is not a job's, or a stats.parquet without a job's
    columns beside _SUCCESS and part-NNNNN files, was taken for a job's OUTPUT_DIR: a glob left
    its files out, a directory INPUT was refused as an unfinished job."""
    write_parquet(tmp_path / "a" / "part-00000.parquet", _prompts(1))
    write_parquet(tmp_path / "a" / "stats.parquet", _prompts(1))
    (tmp_path / "a" / "manifest.json").write_text("{}")
    assert [os.path.basename(f.path) for f in open_inputs(_config(tmp_path / "a"))[0]] == [
        "part-00000.parquet", "stats.parquet"]
    assert len(open_inputs(_config(tmp_path / "*" / "*.parquet"))[0]) == 2
    (tmp_path / "a" / "manifest.json").unlink()
    (tmp_path / "a" / "_SUCCESS").write_bytes(b"")
    assert len(open_inputs(_config(tmp_path / "a"))[0]) == 2


def test_files_with_different_schemas_are_refused(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", _prompts(1))
    write_parquet(tmp_path / "b.parquet", {**_prompts(1), "extra": [1]})
    with pytest.raises(JobError, match=r"b.parquet: its schema differs from .*a.parquet's"):
        open_inputs(_config(tmp_path))


def test_generated_ids_of_a_glob_over_files_of_one_name_come_from_their_paths(
        tmp_path: Path) -> None:
    """Files of one name in several folders were refused ('ids made from file names would
    repeat'); their ids now start with their paths under the glob's fixed folders, as a
    directory INPUT's do. Where the names differ, ids start with the names, as before."""
    write_parquet(tmp_path / "x" / "part.parquet", {"prompt": ["a"]})
    write_parquet(tmp_path / "y" / "part.parquet", {"prompt": ["b"]})
    write_parquet(tmp_path / "y" / "other.parquet", {"prompt": ["c"]})
    files = open_inputs(_config(tmp_path / "*" / "part.parquet"))[0]
    assert [f.id_stem for f in files] == ["x/part", "y/part"]
    files = open_inputs(_config(tmp_path / "y" / "*.parquet"))[0]
    assert [f.id_stem for f in files] == ["other", "part"]
    # a '**' glob through a symlink back up reads each file once (it read this one 41 times,
    # each copy with ids of its own path)
    (tmp_path / "x" / "loop").symlink_to("..")
    files = open_inputs(_config(tmp_path / "**" / "part.parquet"))[0]
    assert [f.id_stem for f in files] == ["x/part", "y/part"]
    (tmp_path / "x" / "loop").unlink()
    # names that differ only in their suffix still make the same ids: refused, named
    write_parquet(tmp_path / "y" / "part.pq", {"prompt": ["d"]})
    with pytest.raises(JobError, match=r"no 'id' column, and ids made from file names would "
                                       r"repeat: .*y/part.parquet and .*y/part.pq"):
        open_inputs(_config(tmp_path / "y" / "part.*"))


def test_duplicate_id_across_files_names_id_files_and_rows(tmp_path: Path) -> None:
    a = write_parquet(tmp_path / "a.parquet", {"id": ["r0", "r1", "r2"], "prompt": ["x"] * 3})
    b = write_parquet(tmp_path / "b.parquet", {"id": ["r3", "r1"], "prompt": ["x"] * 2})
    with pytest.raises(JobError) as err:
        plan_inputs(_config(tmp_path))
    assert str(err.value) == (f"duplicate id 'r1' in column 'id': {a} row 1 and {b} row 1; "
                              f"ids must be unique")


def test_duplicate_integer_id_within_a_file(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet", {"id": [7, 8, 9, 8], "prompt": ["x"] * 4},
                         row_group_size=2)
    with pytest.raises(JobError, match=rf"duplicate id 8 in column 'id': {path} row 1 and "
                                       rf"{path} row 3"):
        plan_inputs(_config(path))


def test_hash_collision_is_not_a_duplicate(tmp_path: Path) -> None:
    assert hash(-1) == hash(-2)  # CPython: -1 is reserved, so both hash to -2
    path = write_parquet(tmp_path / "a.parquet", {"id": [-1, -2, 5], "prompt": ["x"] * 3})
    plan = plan_inputs(_config(path))
    assert [s.num_rows for s in plan.shards] == [3]


def test_null_id_is_refused_with_its_row(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet", {"id": ["a", "b", None], "prompt": ["x"] * 3})
    with pytest.raises(JobError, match=rf"^{path}: id column 'id' is null at row 2$"):
        plan_inputs(_config(path))


def test_plan_without_id_column(tmp_path: Path) -> None:
    write_parquet(tmp_path / "in.parquet", {"prompt": ["a", "b", "c"]})
    plan = plan_inputs(_config(tmp_path / "in.parquet", shard_rows=2))
    assert not plan.has_id_column
    assert [(s.start, s.stop) for s in plan.shards] == [(0, 2), (2, 3)]


def test_a_glob_spelled_otherwise_on_resume_is_refused_where_ids_would_change(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    """Ids made from paths under a glob's fixed folders depend on its spelling: a resume with
    'n*/*/a.parquet' for 'n/*/a.parquet' mixed 'y/a:0' and 'n/y/a:0' in one output."""
    for folder in ("x", "y"):
        write_parquet(tmp_path / "n" / folder / "a.parquet", {"prompt": [f"Tell me {folder}"]})
    out = tmp_path / "out"

    def config(spec: str) -> JobConfig:
        return JobConfig(input=spec, output_dir=str(out), shard_rows=1, max_tokens=2,
                         engine=EngineConfig(model=str(tiny_model_dir)))
    run_job(config(f"{tmp_path}/n/*/a.parquet"), lambda _: tiny_engine, progress=False)
    assert read_parts(out).column("id").to_pylist() == ["x/a:0", "y/a:0"]
    with pytest.raises(JobError, match=re.escape(
            f"{tmp_path}/n/x/a.parquet: ids made for its rows would start with 'n/x/a', not "
            "'x/a' (the glob is spelled otherwise: give it as before)")):
        run_job(config(f"{tmp_path}/n*/*/a.parquet"), lambda _: tiny_engine, progress=False)
