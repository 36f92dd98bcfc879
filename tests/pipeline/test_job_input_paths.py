"""Input paths and output directories that broke jobs: Hive partition folders, globs, inputs
inside OUTPUT_DIR, a disk that fills up, an input file changed while the job runs. Real engine
on the tiny checkpoint, real Parquet files."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.shard
from pipeline.atomic import write_atomically
from pipeline.config import JobError
from pipeline.job import run_job
from runtime.engine import Engine
from tests.pipeline.bad_input_cases import PROMPTS, _config, _greedy
from tests.pipeline.helpers import hidden_files, read_parts, write_parquet


def test_a_hive_partitioned_directory_gives_its_values_as_columns_and_resumes(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    """lang=en/part-0.parquet, lang=fr/part-0.parquet (Spark's and Hive's layout): the folder
    values are a string column of the output, ids are made from the paths under INPUT (the file
    names repeat), and an OUTPUT_DIR inside INPUT is not read back as input on a rerun."""
    write_parquet(tmp_path / "in" / "lang=fr" / "part-0.parquet", {"prompt": PROMPTS[:2]})
    write_parquet(tmp_path / "in" / "lang=en" / "part-0.parquet", {"prompt": PROMPTS[2:]})
    config = _config(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "in" / "out"))
    summary = run_job(config, lambda _: tiny_engine, progress=False)
    assert (summary.totals.rows, summary.totals.errors, summary.complete) == (3, 0, True)
    rows = read_parts(tmp_path / "in" / "out").to_pylist()
    assert [(r["id"], r["prompt"], r["lang"]) for r in rows] == [
        ("lang=en/part-0:0", PROMPTS[2], "en"), ("lang=fr/part-0:0", PROMPTS[0], "fr"),
        ("lang=fr/part-0:1", PROMPTS[1], "fr")]
    assert [r["completion_token_ids"] for r in rows] == [
        _greedy(tiny_engine, p) for p in (PROMPTS[2], PROMPTS[0], PROMPTS[1])]
    again = run_job(config, lambda _: tiny_engine, progress=False)  # a finished job: nothing to do
    assert (again.totals.rows, again.complete) == (3, True)
    assert read_parts(tmp_path / "in" / "out").to_pylist() == rows
    # OUTPUT_DIR = INPUT is refused before anything is written (before, the first run wrote its
    # part files beside the partition folders, and every rerun was refused as "files at its top")
    with pytest.raises(JobError, match=re.escape(
            f"OUTPUT_DIR {tmp_path / 'in'} is the INPUT directory; the job's part files would sit "
            f"beside its partition folders")):
        run_job(_config(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "in")),
                lambda _: tiny_engine, progress=False)
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["lang=en", "lang=fr", "out"]
    # another OUTPUT_DIR: the earlier job's output folder inside INPUT is not read as input
    # (before: refused as "out/part-00000.parquet: a folder not named key=value")
    other = run_job(_config(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "out2")),
                    lambda _: tiny_engine, progress=False)
    assert (other.totals.rows, other.complete) == (3, True)
    assert read_parts(tmp_path / "out2").to_pylist() == rows


def test_a_job_started_from_a_glob_is_not_resumed_from_the_partitioned_directory(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    """Its later part files would gain the partition column (and, without an id column, other
    ids): the manifest keeps each file's partitions, and a change of them is refused."""
    write_parquet(tmp_path / "in" / "lang=en" / "a.parquet", {"id": ["a"], "prompt": PROMPTS[:1]})
    write_parquet(tmp_path / "in" / "lang=fr" / "b.parquet", {"id": ["b"], "prompt": PROMPTS[1:2]})
    glob_config = _config(tmp_path, tiny_model_dir, input=str(tmp_path / "in" / "*" / "*.parquet"))
    run_job(glob_config, lambda _: tiny_engine, progress=False)
    with pytest.raises(JobError, match=re.escape(
            f"the input changed since {tmp_path / 'out'} was written "
            f"({tmp_path / 'in' / 'lang=en' / 'a.parquet'} was read with no partition columns, "
            f"now with partition columns lang=en (a directory INPUT reads partition folders' "
            f"values, a glob does not))")):
        run_job(_config(tmp_path, tiny_model_dir), lambda _: tiny_engine, progress=False)


def test_an_output_dir_holding_the_input_is_refused_and_nothing_is_deleted(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    both = tmp_path / "in"
    part = write_parquet(both / "part-00000.parquet", {"id": ["a"], "prompt": ["hi"]})
    for overwrite in (False, True):
        config = _config(tmp_path, tiny_model_dir, output_dir=str(both), overwrite=overwrite)
        with pytest.raises(JobError, match=f"OUTPUT_DIR {both} holds the input file {part}; "):
            run_job(config, progress=False)
    assert sorted(os.listdir(both)) == ["part-00000.parquet"]
    assert pq.read_table(part).to_pylist() == [{"id": "a", "prompt": "hi"}]


def test_a_failed_write_names_the_file_and_a_rerun_resumes(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    write_parquet(tmp_path / "in" / "x.parquet", {"id": list("abc"), "prompt": PROMPTS})
    write_part = pipeline.shard.write_part

    def disk_full_on_the_second(output_dir: str, name: str, table: pa.Table) -> None:
        if name != "part-00000.parquet":
            def fill(f: BinaryIO) -> None:  # a write to a full disk names no file
                f.write(b"PAR1")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            write_atomically(os.path.join(output_dir, name), fill)
        write_part(output_dir, name, table)

    monkeypatch.setattr(pipeline.shard, "write_part", disk_full_on_the_second)
    config = _config(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    with pytest.raises(JobError, match=f"^{out / 'part-00001.parquet'}: No space left on device; "
                                       "the shards committed so far are kept: rerun"):
        run_job(config, lambda _: tiny_engine, progress=False)
    assert sorted(n for n in os.listdir(out) if n.startswith("part-")) == ["part-00000.parquet"]
    assert hidden_files(out) == []  # the temp file of the failed write is gone
    monkeypatch.setattr(pipeline.shard, "write_part", write_part)
    summary = run_job(config, lambda _: tiny_engine, progress=False)
    assert (summary.shards_resumed, summary.shards_run, summary.complete) == (1, 1, True)
    assert read_parts(out).column("id").to_pylist() == list("abc")


def test_a_glob_that_matches_the_jobs_own_part_files_resumes(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    """'data/*/*.parquet' into data/out: once part files exist there, the glob matches them; they
    are the job's outputs, not its input."""
    data = tmp_path / "data"
    write_parquet(data / "2024" / "a.parquet", {"id": ["a", "b"], "prompt": PROMPTS[:2]})
    write_parquet(data / "2025" / "b.parquet", {"id": ["c"], "prompt": PROMPTS[2:]})
    (data / "out").mkdir()
    write_parquet(data / "out" / "part-notes.parquet", {"id": ["z"], "prompt": ["mine"]})
    config = _config(tmp_path, tiny_model_dir, input=str(data / "*" / "*.parquet"),
                     output_dir=str(data / "out"))
    with pytest.raises(JobError, match="OUTPUT_DIR .* holds the input file .*part-notes.parquet"):
        run_job(config, lambda _: tiny_engine, progress=False)
    (data / "out" / "part-notes.parquet").rename(data / "notes.parquet")
    write_part = pipeline.shard.write_part

    def stop_after_the_first(output_dir: str, name: str, table: pa.Table) -> None:
        write_part(output_dir, name, table)
        raise KeyboardInterrupt  # the job is killed after its first part file

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline.shard, "write_part", stop_after_the_first)
        with pytest.raises(KeyboardInterrupt):
            run_job(config, lambda _: tiny_engine, progress=False)
    assert (data / "out" / "part-00000.parquet").exists()
    summary = run_job(config, lambda _: tiny_engine, progress=False)
    assert (summary.shards_resumed + summary.shards_run, summary.complete) == (2, True)
    assert read_parts(data / "out").column("id").to_pylist() == ["a", "b", "c"]


def test_an_input_file_changed_during_the_job_stops_it_naming_the_file(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards are planned from the files' row groups at the start: a file rewritten meanwhile
    would give other rows (or miss its new ones) with a _SUCCESS."""
    write_parquet(tmp_path / "in" / "a.parquet", {"id": ["a", "b"], "prompt": PROMPTS[:2]})
    second = write_parquet(tmp_path / "in" / "b.parquet", {"id": ["c"], "prompt": PROMPTS[2:]})
    write_part = pipeline.shard.write_part

    def growing_b(output_dir: str, name: str, table: pa.Table) -> None:
        write_part(output_dir, name, table)
        write_parquet(second, {"id": ["c", "d", "e"], "prompt": PROMPTS})

    monkeypatch.setattr(pipeline.shard, "write_part", growing_b)
    with pytest.raises(JobError, match=f"^{second} changed while the job ran \\(size "
                                       r"\d+ -> \d+ bytes\); the shards committed so far were "
                                       "read from it as it was: rerun with --overwrite"):
        run_job(_config(tmp_path, tiny_model_dir), lambda _: tiny_engine, progress=False)
    assert not (tmp_path / "out" / "_SUCCESS").exists()
