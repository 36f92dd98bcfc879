"""`eaglebatch report OUTPUT_DIR` on a real finished job and on a half-finished one."""

from __future__ import annotations

import os
from pathlib import Path

from click.testing import CliRunner
from matplotlib.image import imread

from jobs.cli import main
from pipeline.bench.job_report import PLOTS, _shards
from pipeline.manifest import Manifest
from pipeline.stats import Counts, write_stats
from runtime.config import DEFAULT_MODEL
from runtime.loader import default_drafter
from tests.pipeline.bench.conftest import BENCH_PROMPTS
from tests.pipeline.helpers import write_parquet

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _report(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["report", *args])
    return result.exit_code, result.stdout, result.stderr


def test_report_of_a_finished_job_with_a_drafter(
        tmp_path: Path, tiny_model_dir: Path, tiny_drafter_dir: Path,
        one_thread_module: None) -> None:
    inputs = write_parquet(tmp_path / "in.parquet", {"prompt": [*BENCH_PROMPTS, ""]})
    out = tmp_path / "job"
    generated = CliRunner().invoke(main, [
        "generate", str(inputs), str(out), "--model", str(tiny_model_dir), "--drafter",
        str(tiny_drafter_dir), "--num-speculative-tokens", "2", "--max-tokens", "5",
        "--draft-confidence", "0",  # random drafter: its confidence means nothing
        "--shard-rows", "2", "--kv-cache-memory", "16MiB"])
    assert generated.exit_code == 0, generated.output
    code, stdout, _ = _report(str(out))
    assert code == 0 and stdout == f"wrote {out / 'report.md'}\n"
    report = (out / "report.md").read_text()
    assert "- 3 of 3 shards committed; complete (_SUCCESS written)" in report
    assert f"drafter `{tiny_drafter_dir}`, k = 2" in report
    assert "| rows | 5 |" in report and "| error rows | 1 |" in report
    assert "| acceptance rate |" in report
    for shard in range(3):
        assert f"\n| {shard} | " in report
    for name in PLOTS.values():
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE
        assert f"]({name})" in report
    errors = imread(out / PLOTS["errors"])[..., :3]
    red = ((abs(errors - [0.84, 0.15, 0.16]) < 0.05).all(axis=-1)).sum()
    assert red > 100  # the one error row's bar (shard 2)
    # --overwrite discards the outputs, and the report of them beside them
    again = CliRunner().invoke(main, [
        "generate", str(inputs), str(out), "--model", str(tiny_model_dir), "--drafter", "none",
        "--max-tokens", "3", "--shard-rows", "5", "--kv-cache-memory", "16MiB", "--overwrite"])
    assert again.exit_code == 0, again.output
    assert sorted(os.listdir(out)) == [".eaglebatch.lock", "_SUCCESS", "manifest.json",
                                       "part-00000.parquet", "stats.parquet"]
    code, _, stderr = _report(str(out / "part-00000.parquet"))
    assert code == 2 and stderr == (f"error: OUTPUT_DIR {out / 'part-00000.parquet'}: a file, "
                                    "not a directory\n")


def test_report_of_a_half_finished_job_goes_to_out(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    shards = {0: Counts(rows=10, errors=2, prompt_tokens=50, completion_tokens=200,
                        wall_seconds=4.0),
              1: Counts(rows=10, prompt_tokens=50, completion_tokens=100, wall_seconds=4.0)}
    manifest = Manifest({"model": "m", "drafter": None, "sampling": {"max_tokens": 20},
                         "n": 1, "shard_rows": 10}, [{"path": "in.parquet"}], 5, shards)
    manifest.save(str(job))
    write_stats(str(job), shards)
    for shard, mtime in ((0, 1_000_000.0), (1, 1_000_060.0)):
        part = job / f"part-{shard:05d}.parquet"
        part.write_bytes(b"")
        os.utime(part, (mtime, mtime))
    code, _, _ = _report(str(job), "--out", str(tmp_path / "rep"))
    assert code == 0
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "- 2 of 5 shards committed; not complete" in report
    assert "| output tokens/s | 37.5 |" in report
    assert "| 0 | 10 | 2 | 200 | 4.0 | 50.0 | – |" in report
    assert "- acceptance: not drawn" in report  # no drafter
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == sorted(
        ["report.md", PLOTS["throughput"], PLOTS["errors"]])
    assert not (job / "report.md").exists()


def test_report_of_a_directory_without_job_outputs_is_a_user_error(tmp_path: Path) -> None:
    code, _, stderr = _report(str(tmp_path))
    assert code == 2
    assert stderr.startswith(f"error: {tmp_path} has no manifest.json, stats.parquet")


def test_the_shipped_drafter_is_named_not_its_install_path(tmp_path: Path) -> None:
    shipped = default_drafter(DEFAULT_MODEL)
    assert shipped is not None
    shards = {0: Counts(rows=1, prompt_tokens=5, completion_tokens=8, wall_seconds=1.0,
                        drafted=6, accepted=3, draft_steps=4)}
    for name, drafter, label in (
            ("a", str(shipped), f"drafter shipped ({shipped.name}), k = 2"),
            ("b", str(tmp_path / "mine"), f"drafter `{tmp_path / 'mine'}`, k = 2")):
        job = tmp_path / name
        job.mkdir()
        Manifest({"model": DEFAULT_MODEL, "drafter": drafter, "num_speculative_tokens": 2,
                  "sampling": {"max_tokens": 8}, "n": 1, "shard_rows": 1},
                 [{"path": "in.parquet"}], 1, shards).save(str(job))
        write_stats(str(job), shards)
        code, _, stderr = _report(str(job))
        assert code == 0, stderr
        assert f"- model `{DEFAULT_MODEL}`; {label}" in (job / "report.md").read_text()


def test_a_damaged_stats_file_without_a_manifest_is_a_user_error(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    stats = job / "stats.parquet"
    stats.write_bytes(b"not parquet")
    code, _, stderr = _report(str(job))
    assert code == 2
    assert stderr.startswith(f"error: {stats}: cannot read it as Parquet (")
    assert stderr.endswith("and there is no manifest.json to report from\n")
    write_parquet(stats, {"shard_id": [0], "rows": [3]})
    code, _, stderr = _report(str(job))
    assert code == 2
    assert stderr == (f"error: {stats} lacks the column(s) errors, prompt_tokens, "
                      "completion_tokens, wall_seconds, drafted, accepted: not an eaglebatch "
                      "job's stats.parquet\n")
    assert not (job / "report.md").exists()


def test_without_a_manifest_the_counts_come_back_from_stats_parquet(tmp_path: Path) -> None:
    shards = {0: Counts(rows=3, errors=1, prompt_tokens=40, completion_tokens=90,
                        wall_seconds=2.5, drafted=30, accepted=12),
              2: Counts(rows=1, prompt_tokens=5, completion_tokens=7, wall_seconds=0.5)}
    write_stats(str(tmp_path), shards)
    assert _shards(None, tmp_path / "stats.parquet") == shards
