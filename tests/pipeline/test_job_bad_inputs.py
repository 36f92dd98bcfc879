"""Inputs and output directories that broke jobs: strings that are not UTF-8, columns pandas
writes with Arrow's null type, inputs inside OUTPUT_DIR, a disk that fills up, a temperature so
small that dividing by it overflows. Real engine on the tiny checkpoint, real Parquet files."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.shard
from pipeline.atomic import write_atomically
from pipeline.config import JobConfig, JobError
from pipeline.job import run_job
from pipeline.job_engine import build_engine
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from tests.pipeline.helpers import (
    corrupt_page,
    hidden_files,
    not_utf8,
    read_parts,
    write_parquet,
)

PROMPTS = ["Paris is the capital of", "The quick brown fox", "To bake bread, mix"]


def _config(tmp_path: Path, model_dir: Path, **kw: Any) -> JobConfig:
    engine = EngineConfig(model=str(model_dir), kv_cache_memory=16 << 20)
    options = {"input": str(tmp_path / "in"), "output_dir": str(tmp_path / "out"),
               "shard_rows": 2, "max_tokens": 5, **kw}
    return JobConfig(engine=engine, **options)


def _greedy(engine: Engine, prompt: str, max_tokens: int = 5) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                tokenize=False, add_generation_prompt=True)
    ids = tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    [done] = engine.generate([GenerationRequest("x", ids, SamplingParams(max_tokens=max_tokens))])
    return list(done.token_ids)


@pytest.mark.parametrize("with_ids", [True, False])
def test_rows_of_a_row_group_that_cannot_be_read_are_error_rows_and_the_rest_generate(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine, with_ids: bool) -> None:
    """A corrupt page (the footer intact): the rows of its row group come back as error rows
    naming the file and rows, with what of them can still be read; the job goes on."""
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]  # 12 rows, 3 groups of 4
    columns: dict[str, Any] = {"prompt": prompts, "n": list(range(12))}
    if with_ids:
        columns = {"id": [f"r{i}" for i in range(12)], **columns}
    path = write_parquet(tmp_path / "in" / "x.parquet", columns, row_group_size=4)
    reference = tmp_path / "reference"
    run_job(_config(tmp_path, tiny_model_dir, output_dir=str(reference), shard_rows=3),
            lambda _: tiny_engine, progress=False)
    corrupt_page(path, group=1, column=list(columns).index("prompt"))  # rows 4-7's prompts
    summary = run_job(_config(tmp_path, tiny_model_dir, shard_rows=3), lambda _: tiny_engine,
                      progress=False)
    assert (summary.totals.rows, summary.totals.errors, summary.complete) == (12, 4, True)
    got, want = read_parts(tmp_path / "out").to_pylist(), read_parts(reference).to_pylist()
    ids = [f"r{i}" for i in range(12)] if with_ids else [f"x:{i}" for i in range(12)]
    assert [r["id"] for r in got] == ids
    for i, (row, good) in enumerate(zip(got, want, strict=True)):
        if 4 <= i < 8:
            assert (row["finish_reason"], row["prompt"], row["n"], row["completion"]) == (
                "error", None, i, None)  # n reads on its own; the prompt does not
            assert row["error"].startswith(f"{path}: cannot read row group 1 (rows 4-7): ")
        else:
            assert row == good


def test_a_prompt_or_stop_string_that_is_not_utf8_fails_only_its_row(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    stops = pa.ListArray.from_arrays(pa.array([0, 1, 1, 2], pa.int32()),
                                     not_utf8(["§§", "qq"], 1))
    write_parquet(tmp_path / "in" / "x.parquet",
                  {"id": ["a", "b", "c"], "prompt": not_utf8(PROMPTS, 1), "stop": stops})
    summary = run_job(_config(tmp_path, tiny_model_dir), lambda _: tiny_engine, progress=False)
    # the input columns pass through unchanged, bad bytes included
    parts = read_parts(tmp_path / "out")
    assert parts.column("prompt").equals(pa.chunked_array([not_utf8(PROMPTS, 1)]))
    rows = parts.drop_columns(["prompt", "stop"]).to_pylist()
    assert [(r["id"], r["finish_reason"], r["error"]) for r in rows] == [
        ("a", "length", None),
        ("b", "error", "prompt is not valid UTF-8 (invalid start byte at byte 0: "
                       "b'\\xff\\xfee ')"),
        ("c", "error", "stop is not valid UTF-8 (invalid start byte at byte 0: b'\\xff\\xfe')")]
    assert rows[0]["completion_token_ids"] == _greedy(tiny_engine, PROMPTS[0])
    assert (summary.totals.rows, summary.totals.errors, summary.complete) == (3, 2, True)


def test_all_null_columns_of_arrows_null_type_are_rows_without_values(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    # pandas writes a column of None only as Arrow's null type
    write_parquet(tmp_path / "in" / "x.parquet",
                  {"id": ["a", "b"], "prompt": PROMPTS[:2], "max_tokens": pa.nulls(2)})
    write_parquet(tmp_path / "nulls" / "y.parquet", {"id": ["c"], "prompt": pa.nulls(1)})
    run_job(_config(tmp_path, tiny_model_dir), lambda _: tiny_engine, progress=False)
    rows = read_parts(tmp_path / "out").to_pylist()
    assert [r["completion_token_ids"] for r in rows] == [_greedy(tiny_engine, p)
                                                         for p in PROMPTS[:2]]
    run_job(_config(tmp_path, tiny_model_dir, input=str(tmp_path / "nulls"),
                    output_dir=str(tmp_path / "out2")), lambda _: tiny_engine, progress=False)
    [row] = read_parts(tmp_path / "out2").to_pylist()
    assert (row["id"], row["finish_reason"], row["error"]) == ("c", "error", "prompt is null")


def test_files_whose_schemas_differ_are_refused_naming_the_column(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    first = write_parquet(tmp_path / "in" / "a.parquet", {"id": ["a"], "prompt": ["hi"]})
    second = write_parquet(tmp_path / "in" / "b.parquet", {"id": ["b"], "prompt": pa.nulls(1)})
    with pytest.raises(JobError, match=f"^{second}: its schema differs from {first}'s: column "
                                       "'prompt' is null, not string; every input file"):
        run_job(_config(tmp_path, tiny_model_dir), progress=False)
    write_parquet(second, {"id": ["b"], "prompt": ["x"], "extra": [1]})
    with pytest.raises(JobError, match="differs from .*: an extra column 'extra'; "):
        run_job(_config(tmp_path, tiny_model_dir), progress=False)
    assert not (tmp_path / "out").exists()


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


def test_files_with_the_same_columns_in_another_order_are_read_in_the_first_files_order(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    """Writers differ in column order (pandas, Spark, a hand-built table): the rows of every
    file come out in the first file's order, so all part files have one schema."""
    write_parquet(tmp_path / "in" / "a.parquet",
                  {"id": ["a", "b"], "prompt": PROMPTS[:2], "n": [1, 2]})
    write_parquet(tmp_path / "in" / "b.parquet",
                  {"n": [3, None, 5], "prompt": [PROMPTS[2], None, PROMPTS[0]],
                   "id": ["c", "d", "e"]})
    summary = run_job(_config(tmp_path, tiny_model_dir), lambda _: tiny_engine, progress=False)
    assert (summary.totals.rows, summary.totals.errors, summary.complete) == (5, 1, True)
    schemas = [pq.read_schema(p) for p in sorted((tmp_path / "out").glob("part-*.parquet"))]
    assert len(schemas) == 3 and all(s.equals(schemas[0]) for s in schemas)
    assert schemas[0].names[:3] == ["id", "prompt", "n"]
    rows = read_parts(tmp_path / "out").to_pylist()
    assert [(r["id"], r["prompt"], r["n"], r["error"]) for r in rows] == [
        ("a", PROMPTS[0], 1, None), ("b", PROMPTS[1], 2, None), ("c", PROMPTS[2], 3, None),
        ("d", None, None, "prompt is null"), ("e", PROMPTS[0], 5, None)]
    assert [r["completion_token_ids"] for r in rows] == [
        _greedy(tiny_engine, PROMPTS[0]), _greedy(tiny_engine, PROMPTS[1]),
        _greedy(tiny_engine, PROMPTS[2]), None, _greedy(tiny_engine, PROMPTS[0])]


def test_files_that_differ_only_in_nullability_run_as_one_job(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    """Spark writes columns without nulls as required, pandas as optional; a job may get both.
    Every part file gets the same schema (input columns nullable: a row group that cannot be read
    gives its columns nulls, which a required column could not hold)."""
    required = pa.schema([pa.field("id", pa.string(), nullable=False),
                          pa.field("prompt", pa.string(), nullable=False)])
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]  # 6 rows
    spark = write_parquet(tmp_path / "in" / "a.parquet",
                          {"id": [f"a{i}" for i in range(6)], "prompt": prompts},
                          row_group_size=2, schema=required)
    write_parquet(tmp_path / "in" / "b.parquet", {"id": ["b0"], "prompt": prompts[:1]})
    corrupt_page(spark, group=1, column=1)  # the prompts of a2 and a3
    summary = run_job(_config(tmp_path, tiny_model_dir), lambda _: tiny_engine, progress=False)
    assert (summary.totals.rows, summary.totals.errors, summary.complete) == (7, 2, True)
    schemas = {pq.read_schema(p) for p in sorted((tmp_path / "out").glob("part-*.parquet"))}
    assert len(schemas) == 1
    [schema] = schemas
    assert (schema.field("id").nullable, schema.field("prompt").nullable) == (True, True)
    rows = read_parts(tmp_path / "out").to_pylist()
    assert [(r["id"], r["finish_reason"]) for r in rows] == [
        ("a0", "length"), ("a1", "length"), ("a2", "error"), ("a3", "error"), ("a4", "length"),
        ("a5", "length"), ("b0", "length")]
    assert (rows[2]["prompt"], rows[3]["prompt"]) == (None, None)
    assert rows[2]["error"].startswith(f"{spark}: cannot read row group 1 (rows 2-3): ")
    assert rows[6]["completion_token_ids"] == rows[0]["completion_token_ids"] \
        == _greedy(tiny_engine, prompts[0])


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


def test_a_temperature_too_small_to_divide_by_samples_greedily(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    write_parquet(tmp_path / "in" / "x.parquet",
                  {"id": ["a", "b"], "prompt": PROMPTS[:2], "temperature": [None, 1e-40]})
    run_job(_config(tmp_path, tiny_model_dir, temperature=1e-30, seed=1),
            lambda _: tiny_engine, progress=False)
    rows = read_parts(tmp_path / "out").to_pylist()
    assert [r["completion_token_ids"] for r in rows] == [_greedy(tiny_engine, p)
                                                         for p in PROMPTS[:2]]
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy


def test_a_kv_cache_budget_that_holds_nothing_names_the_option(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1024)
    with pytest.raises(JobError, match="^--kv-cache-memory 1024: KV cache budget of 1024 bytes "
                                       "holds 0 blocks of "):
        build_engine(Engine, config)


def test_an_attention_backend_this_machine_lacks_names_the_option(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", attention_backend="flash")
    with pytest.raises(JobError, match=re.escape(
            "--attention-backend flash needs CUDA and the flash-attn package (pip install -e "
            ".[gpu])")):
        build_engine(Engine, config)


def test_a_job_refused_at_its_model_leaves_no_output_dir(tmp_path: Path) -> None:
    write_parquet(tmp_path / "in" / "x.parquet", {"id": ["a"], "prompt": ["hi"]})
    missing = tmp_path / "no-model"
    config = _config(tmp_path, missing)
    with pytest.raises(JobError, match=f"^cannot load --model {missing}: "):
        run_job(config, progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()  # a directory that was there stays
    with pytest.raises(JobError, match=f"^cannot load --model {missing}: "):
        run_job(config, progress=False)
    assert os.listdir(tmp_path / "out") == [".eaglebatch.lock"]


def test_a_config_that_disagrees_with_its_weights_names_the_tensor(tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights have 128
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(JobError, match=re.escape(
            f"cannot load --model {model}: checkpoint does not match its config.json: "
            "model.layers.0.mlp.down_proj.weight has shape (64, 128), the config gives (64, 96)")):
        build_engine(Engine, EngineConfig(model=str(model), kv_cache_memory=1 << 20))


def test_repeated_column_names_are_refused_naming_the_column(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    twice = pa.table([pa.array(["a"]), pa.array(["hi"]), pa.array(["yo"])],
                     names=["id", "prompt", "prompt"])
    pq.write_table(twice, tmp_path / "twice.parquet")
    with pytest.raises(JobError, match=f"^{tmp_path / 'twice.parquet'}: the input has two "
                                       "columns named 'prompt'; column names must be unique$"):
        run_job(_config(tmp_path, tiny_model_dir, input=str(tmp_path / "twice.parquet")),
                progress=False)
    write_parquet(tmp_path / "in" / "a.parquet", {"id": ["a"], "prompt": ["hi"], "x": [1]})
    pq.write_table(pa.table([pa.array(["b"]), pa.array(["yo"]), pa.array([1]), pa.array([2])],
                            names=["id", "prompt", "x", "x"]), tmp_path / "in" / "b.parquet")
    with pytest.raises(JobError, match="b.parquet: its schema differs from .*a.parquet's: two "
                                       "columns named 'x'; "):
        run_job(_config(tmp_path, tiny_model_dir), progress=False)
    assert not (tmp_path / "out").exists()


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


def test_a_kv_cache_budget_of_zero_is_named_as_given(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory=0)
    with pytest.raises(JobError, match="^--kv-cache-memory 0: KV cache budget of 0 bytes "):
        build_engine(Engine, config)


@pytest.mark.parametrize("with_ids", [True, False])
def test_an_input_without_rows_writes_one_empty_part_file(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine, with_ids: bool) -> None:
    """So that readers of part-*.parquet find the output columns instead of no file (the job
    makes the id column when the input has none)."""
    empty = pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())})
    if not with_ids:
        empty = empty.drop_columns(["id"])
    (tmp_path / "in").mkdir()
    pq.write_table(empty, tmp_path / "in" / "a.parquet")
    pq.write_table(empty, tmp_path / "in" / "b.parquet")
    summary = run_job(_config(tmp_path, tiny_model_dir, n=2), lambda _: tiny_engine,
                      progress=False)
    out = tmp_path / "out"
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == [
        "_SUCCESS", "manifest.json", "part-00000.parquet", "stats.parquet"]
    part = pq.read_table(out / "part-00000.parquet")
    assert part.num_rows == 0
    assert part.column_names[:3] == ["id", "prompt", "sample_index"]
    assert "completion" in part.column_names and "error" in part.column_names
    assert (summary.totals.rows, summary.complete) == (0, True)
    again = run_job(_config(tmp_path, tiny_model_dir, n=2), lambda _: tiny_engine,
                    progress=False)
    assert (again.shards_resumed, again.shards_run) == (1, 0)
