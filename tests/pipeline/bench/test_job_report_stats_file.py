"""`eaglebatch report OUTPUT_DIR` and its stats.parquet: one that does not match the manifest is
said, one without a manifest gives the figures (or, damaged or hand-edited, a one-line error),
one written by an older version is read as such."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from pipeline.bench.job_report import PLOTS, _shards
from pipeline.manifest import Manifest
from pipeline.stats import Counts, write_stats
from tests.pipeline.bench.conftest import PNG_SIGNATURE, _report
from tests.pipeline.helpers import write_parquet


def test_a_stats_file_that_does_not_match_its_manifest_is_said(tmp_path: Path) -> None:
    """stats.parquet beside a readable manifest: the report takes its figures from the manifest,
    but a missing, damaged or foreign stats.parquet is said (it went unmentioned)."""
    manifest = Manifest({"model": "m", "drafter": None, "sampling": {}, "n": 1, "shard_rows": 2},
                        [{"path": "in.parquet"}], 1)
    write_parquet(tmp_path / "part-00000.parquet", {"error": [None, None]})
    manifest.commit(0, Counts(rows=2, completion_tokens=10, wall_seconds=1.0), str(tmp_path))
    manifest.save(str(tmp_path))
    write_stats(str(tmp_path), manifest.shards, manifest.committed_at)
    stats = tmp_path / "stats.parquet"
    good = stats.read_bytes()
    code, _, stderr = _report(str(tmp_path))
    assert (code, stderr) == (0, "")
    assert "stats.parquet**" not in (tmp_path / "report.md").read_text()
    cases = (("missing", b""),
             ("cannot read it as Parquet (Parquet magic bytes not found in footer. Either the "
              "file is corrupted or this is not a parquet file.)", good[:100]),
             ("lacks the column(s) rows, errors", None))
    for problem, data in cases:
        stats.unlink(missing_ok=True)
        if data is None:  # another table under the name
            write_parquet(stats, {"shard_id": [0], "prompt_tokens": [1], "completion_tokens": [10],
                                  "wall_seconds": [1.0], "drafted": [0], "accepted": [0]})
        elif data:
            stats.write_bytes(data)
        code, _, stderr = _report(str(tmp_path))
        assert (code, stderr) == (0, f"{stats}: {problem}; reporting from manifest.json\n")
        report = (tmp_path / "report.md").read_text()
        assert (f"- **stats.parquet**: {problem}; the figures here come from manifest.json "
                "(rerunning the job's command writes stats.parquet again)") in report
        assert "| rows | 2 |" in report


def test_report_of_a_directory_without_job_outputs_is_a_user_error(tmp_path: Path) -> None:
    code, _, stderr = _report(str(tmp_path))
    assert code == 2
    assert stderr.startswith(f"error: {tmp_path} has no manifest.json, stats.parquet")


def test_a_damaged_stats_file_without_a_manifest_is_a_user_error(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    stats = job / "stats.parquet"
    stats.write_bytes(b"not parquet")
    code, _, stderr = _report(str(job))
    assert code == 2
    assert stderr.startswith(f"error: {stats}: cannot read it as Parquet (")
    assert stderr.endswith("and there is no readable manifest.json to report from\n")
    write_parquet(stats, {"shard_id": [0], "rows": [3]})
    code, _, stderr = _report(str(job))
    assert code == 2
    assert stderr == (f"error: {stats} lacks the column(s) errors, prompt_tokens, "
                      "completion_tokens, wall_seconds, drafted, accepted: not an eaglebatch "
                      "job's stats.parquet\n")
    assert not (job / "report.md").exists()


@pytest.mark.parametrize("column, values, why", [
    ("rows", [None], "row 0: a shard's 'rows' is not a number"),
    ("rows", ["3"], "row 0: a shard's 'rows' is not a number"),
    ("wall_seconds", [float("nan")], "row 0: a shard's 'wall_seconds' is nan"),
    ("wall_seconds", [-8.0], "row 0: a shard's 'wall_seconds' is -8.0"),
    ("shard_id", [None], "row 0: shard_id null is not a shard's number, or repeats"),
    ("shard_id", [-7], "row 0: shard_id -7 is not a shard's number, or repeats"),
    ("draft_steps", [-3], "row 0: a shard's 'draft_steps' is -3"),  # found by review
    ("per_position_acceptance", [[float("inf")]],
     "row 0: a shard's 'per_position_acceptance' is [inf]"),
])
def test_a_hand_edited_stats_file_without_a_manifest_is_named_not_a_traceback(
        tmp_path: Path, column: str, values: list[Any], why: str) -> None:
    """Found by QA: a null or text count, or a null shard id, gave a traceback; a NaN or
    negative time, a report of 'nan' or '-42.0 tokens/s'."""
    job = tmp_path / "job"
    job.mkdir()
    stats = job / "stats.parquet"
    row = {"shard_id": [0], "rows": [3], "errors": [0], "prompt_tokens": [40],
           "completion_tokens": [90], "wall_seconds": [2.0], "drafted": [0], "accepted": [0]}
    write_parquet(stats, {**row, column: values})
    code, _, stderr = _report(str(job))
    assert code == 2
    assert stderr == (f"error: {stats}: {why}; not an eaglebatch job's stats.parquet, and there "
                      "is no readable manifest.json to report from\n")
    write_parquet(stats, {**row, "committed_at": ["yesterday"]})
    code, _, stderr = _report(str(job))
    assert (code, stderr) == (2, f"error: {stats}: committed_at is string, not a time; not an "
                                 "eaglebatch job's stats.parquet\n")
    assert not (job / "report.md").exists()


def test_without_a_manifest_the_counts_come_back_from_stats_parquet(tmp_path: Path) -> None:
    shards = {0: Counts(rows=3, errors=1, prompt_tokens=40, completion_tokens=90,
                        wall_seconds=2.5, drafted=30, accepted=12),
              2: Counts(rows=1, prompt_tokens=5, completion_tokens=7, wall_seconds=0.5)}
    write_stats(str(tmp_path), shards, {2: 1_000_000.25})
    assert _shards(None, tmp_path / "stats.parquet") == (shards, {2: 1_000_000.25})
    # draft steps and accepted drafts per position come back from the rates
    shards[0] = Counts(rows=3, errors=1, prompt_tokens=40, completion_tokens=90,
                       wall_seconds=2.5, drafted=30, accepted=12, draft_steps=15,
                       accepted_per_position=[9, 3])
    write_stats(str(tmp_path), shards)
    assert _shards(None, tmp_path / "stats.parquet") == (shards, {})
    assert _report(str(tmp_path))[0] == 0
    report = (tmp_path / "report.md").read_text()
    assert "| mean acceptance length | 1.80 |" in report
    assert "| acceptance by position | 60.0% 20.0% |" in report
    assert (tmp_path / PLOTS["acceptance"]).read_bytes()[:8] == PNG_SIGNATURE
    assert "does not list" not in report
    # a shard that drafted and accepted nothing: its draft steps are in stats.parquet's own
    # column (before it, the report rebuilt them from the mean acceptance length, which such a
    # shard does not tell, and gave 1.80 and 60.0% 20.0% for the job below)
    shards[3] = Counts(rows=2, completion_tokens=20, wall_seconds=1.0, drafted=20, accepted=0,
                       draft_steps=10, accepted_per_position=[0, 0])
    write_stats(str(tmp_path), shards)
    assert _shards(None, tmp_path / "stats.parquet") == (shards, {})
    assert _report(str(tmp_path))[0] == 0
    report = (tmp_path / "report.md").read_text()
    assert "| mean acceptance length | 1.48 |" in report  # 1 + 12 / 25
    assert "| acceptance by position | 36.0% 12.0% |" in report
    # a stats.parquet written before that column: said, not passed off as the job's figures
    table = pq.read_table(tmp_path / "stats.parquet")
    pq.write_table(table.drop_columns(["draft_steps"]), tmp_path / "stats.parquet")
    assert _report(str(tmp_path))[0] == 0
    report = " ".join((tmp_path / "report.md").read_text().split())
    assert "| mean acceptance length | 1.80 |" in report
    assert ("The mean acceptance length and acceptance by position leave out 1 shard that "
            "drafted and accepted nothing, whose draft steps this stats.parquet (written before "
            "it recorded them) does not tell: they are too high.") in report
    # part files of shards that stats.parquet does not list (written after its last save) are
    # named, not counted; Spark's part-00000-<uuid> names are not a job's
    for name in ("part-00002.parquet", "part-00001.parquet", "part-00007.parquet",
                 "part-00003-1a2b.parquet"):
        (tmp_path / name).write_bytes(b"")
    assert _report(str(tmp_path))[0] == 0
    assert ("- no manifest.json: figures come from stats.parquet only\n"
            "- 2 part files that stats.parquet does not list (part-00001.parquet, "
            "part-00007.parquet): not counted here\n") in (tmp_path / "report.md").read_text()


def test_an_old_stats_file_whose_drafting_shards_accepted_nothing(tmp_path: Path) -> None:
    """Found by a reviewer: its acceptance plot read 'nothing was drafted' beside 10 drafted."""
    write_stats(str(tmp_path), {0: Counts(rows=1, completion_tokens=9, wall_seconds=1.0,
                                          drafted=10, accepted=0, draft_steps=5,
                                          accepted_per_position=[0, 0])})
    table = pq.read_table(tmp_path / "stats.parquet")
    pq.write_table(table.drop_columns(["draft_steps"]), tmp_path / "stats.parquet")
    assert _report(str(tmp_path))[0] == 0
    report = (tmp_path / "report.md").read_text()
    assert ("- acceptance: not drawn (the draft steps of the shards that drafted are not in this "
            "stats.parquet)") in report
