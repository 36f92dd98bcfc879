"""Write stage: the exact output schema, row order, and atomic part files."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.atomic import write_atomically
from pipeline.stages.write import RowOutput, assemble, write_part

GENERATED = [
    ("completion", pa.string()), ("completion_token_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()), ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()), ("num_drafted", pa.int32()), ("num_accepted", pa.int32()),
    ("max_tokens_clamped", pa.bool_()), ("error", pa.string()),
]
OK = RowOutput("hi", [5, 6], "length", 3, 2, 0, 0, False, None)
BAD = RowOutput(None, None, "error", None, 0, 0, 0, False, "prompt is null")


def _inputs() -> pa.Table:
    return pa.table({"id": ["a", "b"], "prompt": ["x", None], "meta": [{"k": 1}, {"k": 2}]})


def _types(table: pa.Table) -> list[tuple[str, pa.DataType]]:
    return [(f.name, f.type) for f in table.schema]


def test_schema_and_values_for_n_1() -> None:
    table = assemble(_inputs(), [OK, BAD], n=1, generated_ids=None, id_column="id")
    assert _types(table) == _types(_inputs()) + GENERATED
    assert table.to_pylist() == [
        {"id": "a", "prompt": "x", "meta": {"k": 1}, "completion": "hi",
         "completion_token_ids": [5, 6], "finish_reason": "length", "prompt_tokens": 3,
         "completion_tokens": 2, "num_drafted": 0, "num_accepted": 0,
         "max_tokens_clamped": False, "error": None},
        {"id": "b", "prompt": None, "meta": {"k": 2}, "completion": None,
         "completion_token_ids": None, "finish_reason": "error", "prompt_tokens": None,
         "completion_tokens": 0, "num_drafted": 0, "num_accepted": 0,
         "max_tokens_clamped": False, "error": "prompt is null"}]


def test_n_2_repeats_input_rows_with_sample_index() -> None:
    table = assemble(_inputs(), [OK, OK, BAD, BAD], n=2, generated_ids=None, id_column="id")
    assert _types(table) == _types(_inputs()) + [("sample_index", pa.int32())] + GENERATED
    assert table.column("id").to_pylist() == ["a", "a", "b", "b"]
    assert table.column("sample_index").to_pylist() == [0, 1, 0, 1]
    assert table.column("finish_reason").to_pylist() == ["length", "length", "error", "error"]


def test_generated_ids_come_first() -> None:
    inputs = pa.table({"prompt": ["x", "y"]})
    table = assemble(inputs, [OK, OK], n=1, generated_ids=["in:0", "in:1"], id_column="id")
    assert table.schema.names[:2] == ["id", "prompt"]
    assert table.column("id").to_pylist() == ["in:0", "in:1"]


def test_output_count_must_match() -> None:
    with pytest.raises(ValueError, match="3 outputs for 2 rows x n=1"):
        assemble(_inputs(), [OK, OK, OK], n=1, generated_ids=None, id_column="id")


def test_part_file_is_renamed_into_place_and_leaves_no_temp(tmp_path: Path) -> None:
    table = assemble(_inputs(), [OK, BAD], n=1, generated_ids=None, id_column="id")
    path = write_part(str(tmp_path), "part-00003.parquet", table)
    assert os.listdir(tmp_path) == ["part-00003.parquet"]
    assert pq.read_table(path).equals(table)


def test_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path: Path) -> None:
    final = tmp_path / "part-00000.parquet"
    final.write_bytes(b"old")

    def fail_halfway(f: object) -> None:
        f.write(b"partial")  # type: ignore[attr-defined]
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(str(final), fail_halfway)
    assert os.listdir(tmp_path) == ["part-00000.parquet"]
    assert final.read_bytes() == b"old"
