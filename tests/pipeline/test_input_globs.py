"""A glob or single-file INPUT, on real Parquet files: the hidden names and folders a glob leaves
out (or only matches), paths that are not regular files, missing inputs, ids made from paths
under the glob's fixed folders, kept as spelled on resume."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pipeline.config import JobConfig, JobError
from pipeline.job import run_job
from pipeline.sources import open_inputs
from runtime.config import EngineConfig
from runtime.engine import Engine
from tests.pipeline.helpers import read_parts, write_parquet
from tests.pipeline.input_cases import _config, _prompts, resolve_input


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
