"""A directory INPUT, on real Parquet files: its files sorted (hidden and underscore names left
out), Hive partition folders and their values, symlinked folders, other jobs' outputs inside it,
and the subfolders, partition keys and folders it refuses by name."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

import pipeline.discover as discover
from pipeline.config import JobConfig, JobError
from pipeline.job import run_job
from pipeline.sources import open_inputs, plan_inputs
from runtime.config import EngineConfig
from runtime.engine import Engine
from tests.pipeline.helpers import write_parquet
from tests.pipeline.input_cases import _config, _prompts, resolve_input


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
