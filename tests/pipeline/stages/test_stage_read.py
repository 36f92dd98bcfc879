"""Read stage: exact rows of each shard, across row-group and batch boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import JobConfig, JobError
from pipeline.sources import open_inputs, plan_shards
from pipeline.stages.read import read_shard, read_shard_table
from tests.pipeline.helpers import write_parquet


def _shards(path: Path, shard_rows: int) -> list:
    files, _, _ = open_inputs(JobConfig(input=str(path), output_dir="unused"))
    return plan_shards(files, shard_rows)


def test_shards_read_exact_rows_across_row_groups(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet",
                         {"id": list(range(10)), "prompt": [f"p{i}" for i in range(10)]},
                         row_group_size=4)
    shards = _shards(path, shard_rows=3)
    assert shards[0].file.row_group_rows == (4, 4, 2)
    got = [read_shard_table(s).column("id").to_pylist() for s in shards]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_small_batches_are_sliced_to_the_shard(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet",
                         {"id": list(range(10)), "prompt": [f"p{i}" for i in range(10)]},
                         row_group_size=4)
    shard = _shards(path, shard_rows=5)[1]  # rows 5-9: row groups 1 (4-7) and 2 (8-9)
    batches = list(read_shard(shard, batch_rows=2))
    assert [b.column("id").to_pylist() for b in batches] == [[5], [6, 7], [8, 9]]
    assert read_shard_table(shard).column("prompt").to_pylist() == ["p5", "p6", "p7", "p8", "p9"]


def test_file_shrunk_during_the_job_is_an_error(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(6)), "prompt": ["x"] * 6})
    shard = _shards(path, shard_rows=4)[1]
    write_parquet(path, {"id": list(range(5)), "prompt": ["x"] * 5})
    with pytest.raises(JobError, match=r"in.parquet changed while the job ran \(size \d+ -> "
                                       r"\d+ bytes\)"):
        read_shard_table(shard)
