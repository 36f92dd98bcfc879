"""Input rows and schemas that broke jobs: row groups that cannot be read, strings that are not
UTF-8, columns pandas writes with Arrow's null type, files whose columns differ in order,
nullability or names, inputs without rows, a temperature so small that dividing by it
overflows. Real engine on the tiny checkpoint, real Parquet files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import JobError
from pipeline.job import run_job
from runtime.config import SamplingParams
from runtime.engine import Engine
from tests.pipeline.bad_input_cases import PROMPTS, _config, _greedy
from tests.pipeline.helpers import corrupt_page, not_utf8, read_parts, write_parquet


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
