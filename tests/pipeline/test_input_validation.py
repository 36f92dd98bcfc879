"""Up-front validation and shard planning, on real Parquet files: shards within files, files that
cannot be read (corrupt pages found before generation), schemas and ids refused naming the file,
column and rows."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import JobError
from pipeline.sources import open_inputs, plan_inputs, plan_shards, scan_inputs
from tests.pipeline.helpers import corrupt_page, write_parquet
from tests.pipeline.input_cases import _config, _prompts


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


def test_files_with_different_schemas_are_refused(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", _prompts(1))
    write_parquet(tmp_path / "b.parquet", {**_prompts(1), "extra": [1]})
    with pytest.raises(JobError, match=r"b.parquet: its schema differs from .*a.parquet's"):
        open_inputs(_config(tmp_path))


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
