"""Stats definitions with exact numbers, and stats.parquet."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.stats import Counts, summary_line, total, write_stats

DRAFTING = Counts(rows=4, errors=1, prompt_tokens=40, completion_tokens=30, wall_seconds=2.0,
                  drafted=12, accepted=6, draft_steps=4, accepted_per_position=[3, 2, 1])


def test_derived_rates() -> None:
    assert DRAFTING.derived() == {"output_tokens_per_s": 15.0, "acceptance_rate": 0.5,
                                  "mean_acceptance_length": 2.5,
                                  "per_position_acceptance": [0.75, 0.5, 0.25]}
    assert Counts(rows=1, completion_tokens=3, wall_seconds=1.5).derived() == {
        "output_tokens_per_s": 2.0, "acceptance_rate": None, "mean_acceptance_length": None,
        "per_position_acceptance": []}


def test_totals_add_counters_and_position_lists_of_any_length() -> None:
    t = total([DRAFTING, Counts(rows=2, drafted=2, accepted=1, draft_steps=1,
                                accepted_per_position=[1])])
    assert (t.rows, t.drafted, t.accepted, t.draft_steps) == (6, 14, 7, 5)
    assert t.accepted_per_position == [4, 2, 1]


def test_stats_parquet_has_one_row_per_shard_in_shard_order(tmp_path: Path) -> None:
    write_stats(str(tmp_path), {3: DRAFTING, 1: Counts(rows=2, completion_tokens=4,
                                                       wall_seconds=1.0)},
                {3: 1_765_000_123.4567, 7: 1.0})  # shard 1's time unknown; 7 is not committed
    assert os.listdir(tmp_path) == ["stats.parquet"]
    table = pq.read_table(tmp_path / "stats.parquet")
    assert [(f.name, f.type) for f in table.schema] == [
        ("shard_id", pa.int32()), ("rows", pa.int64()), ("errors", pa.int64()),
        ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
        ("wall_seconds", pa.float64()), ("output_tokens_per_s", pa.float64()),
        ("drafted", pa.int64()), ("accepted", pa.int64()), ("draft_steps", pa.int64()),
        ("acceptance_rate", pa.float64()), ("mean_acceptance_length", pa.float64()),
        ("per_position_acceptance", pa.list_(pa.float64())),
        ("committed_at", pa.timestamp("ms", tz="UTC"))]
    rows = table.to_pylist()
    assert [r["shard_id"] for r in rows] == [1, 3]
    assert rows[1] == {"shard_id": 3, "rows": 4, "errors": 1, "prompt_tokens": 40,
                       "completion_tokens": 30, "wall_seconds": 2.0, "output_tokens_per_s": 15.0,
                       "drafted": 12, "accepted": 6, "draft_steps": 4, "acceptance_rate": 0.5,
                       "mean_acceptance_length": 2.5,
                       "per_position_acceptance": [0.75, 0.5, 0.25],
                       "committed_at": datetime.datetime(2025, 12, 6, 5, 48, 43, 457000,
                                                         tzinfo=datetime.timezone.utc)}
    assert rows[0]["acceptance_rate"] is None and rows[0]["per_position_acceptance"] == []
    assert rows[0]["committed_at"] is None


def test_summary_lines() -> None:
    assert summary_line(Counts(rows=3, errors=1, prompt_tokens=9, completion_tokens=20), 4.0) == (
        "done: 3 rows (1 error), 9 prompt tokens, 20 generated tokens in 4.0 s, 5.0 tokens/s "
        "(prompts 2.2 tokens/s)")
    assert summary_line(DRAFTING, 2.0) == (
        "done: 4 rows (1 error), 40 prompt tokens, 30 generated tokens in 2.0 s, 15.0 tokens/s "
        "(prompts 20.0 tokens/s); "
        "acceptance rate 0.500, mean acceptance length 2.50, per position [0.75, 0.50, 0.25]")
