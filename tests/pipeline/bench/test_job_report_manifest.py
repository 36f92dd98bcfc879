"""`eaglebatch report OUTPUT_DIR` from a job's manifest: a real finished job and a half-finished
one, a report that cannot be written, commit times, missing and damaged part files, shards that
ran side by side, the drafter and sampling options named."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from click.testing import CliRunner
from matplotlib.image import imread

from jobs.cli import main
from pipeline.bench.job_report import PLOTS
from pipeline.manifest import Manifest
from pipeline.stats import Counts, write_stats
from runtime.config import DEFAULT_MODEL
from runtime.loader import default_drafter
from tests.pipeline.bench.conftest import BENCH_PROMPTS, PNG_SIGNATURE, _report
from tests.pipeline.helpers import write_parquet


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
    assert re.search(r"\n- written [-\d: ]{19}, from the files as they were then\n", report)
    assert f"drafter `{tiny_drafter_dir}`, k = 2" in report
    assert "| rows | 5 |" in report and "| error rows | 1 |" in report
    assert "| acceptance rate |" in report
    assert "## Error rows by message\n\n| error rows | error |\n| ---: | --- |\n" in report
    assert "\n| 1 | `" in report and "prompt is empty" in report
    assert "shards not committed yet" not in report and "- 1 run (started): " in report
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
    runs = [{"started": 999_990.0, "runner": "local"},
            {"started": 1_000_050.0, "runner": "ray", "workers": 2}]
    manifest = Manifest({"model": "m", "drafter": None, "sampling": {"max_tokens": 20},
                         "n": 1, "shard_rows": 10}, [{"path": "in.parquet"}], 5, shards, runs)
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
    # a report written while the job runs goes stale as it goes on: it says when it was written
    assert re.search(r"\n- written \d{4}-\d\d-\d\d \d\d:\d\d:\d\d, from the files as they "
                     r"were then \(rerun `eaglebatch report` once the job has gone on\)\n",
                     report)
    # this manifest (as written before commit times were recorded) has none: the files' times
    assert ("- commit times of 2 shards are their part files' modification times (committed by "
            "a version that did not record them; a copy of the directory changes them)") in report
    clock = [time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started"])) for r in runs]
    assert (f"- 2 runs (its start and every resume): {clock[0]} (local); {clock[1]} (ray, "
            "2 workers)") in report
    assert "\n\n\n" not in report
    assert "- shards not committed yet: 2, 3, 4 (rerun the job's command to finish them)\n\n" \
        in report  # no part file of them on disk: nothing more to say
    # a part file the manifest does not list yet (its saves are spaced): said
    (job / "part-00003.parquet").write_bytes(b"")
    assert _report(str(job), "--out", str(tmp_path / "rep"))[0] == 0
    assert ("- shards not committed yet: 2, 3, 4 (rerun the job's command to finish them)\n"
            "- 1 part file of them written since the manifest's last save: a running job "
            "commits them at its next save, a stopped one's rerun generates them again\n") in (
        tmp_path / "rep" / "report.md").read_text()
    (job / "part-00003.parquet").unlink()
    # shards 0 and 1 generated for 4 s each, one after the other: 300 tokens in 8 s
    assert "| seconds in which any shard was generating | 8.000 |" in report
    assert "| output tokens/s | 37.5 |" in report
    assert "| 0 | 10 | 2 | 200 | 4.000 | 50.0 | – |" in report
    assert "- acceptance: not drawn (nothing was drafted)" in report
    # and a note of what it reports on (a report of another job there is refused)
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == sorted(
        [".eaglebatch-report-of", "report.md", PLOTS["throughput"], PLOTS["errors"]])
    assert (tmp_path / "rep" / ".eaglebatch-report-of").read_text() == f"{job}\n"
    assert not (job / "report.md").exists()


def test_a_report_that_cannot_be_written_is_one_line_and_leaves_no_part_file(
        tmp_path: Path) -> None:
    """A plot or report.md that cannot be written (a read-only or full --out; here a directory
    where report.md goes) is a one-line error naming it, and the files written before it are
    whole: each is drawn in memory and written in one rename."""
    job = tmp_path / "job"
    job.mkdir()
    shards = {0: Counts(rows=10, prompt_tokens=50, completion_tokens=200, wall_seconds=4.0)}
    Manifest({"model": "m", "drafter": None, "sampling": {"max_tokens": 20}, "n": 1,
              "shard_rows": 10}, [{"path": "in.parquet"}], 1, shards).save(str(job))
    write_stats(str(job), shards)
    (job / "part-00000.parquet").write_bytes(b"")
    (job / "report.md").mkdir()
    code, _, err = _report(str(job))
    assert code == 2
    assert err == f"error: {job / 'report.md'}: Is a directory; the report is not complete\n"
    assert sorted(p.name for p in job.iterdir()) == sorted(  # no temp file left
        ["manifest.json", "stats.parquet", "part-00000.parquet", "report.md",
         PLOTS["throughput"], PLOTS["errors"]])
    assert (job / PLOTS["throughput"]).read_bytes().startswith(PNG_SIGNATURE)
    imread(job / PLOTS["throughput"])  # whole


def test_recorded_commit_times_not_the_part_files_and_missing_part_files_named(
        tmp_path: Path) -> None:
    """A copy of the job's directory (new modification times) reports the same figures: the
    commit times are the job's record. A committed shard's part file that is gone is named."""
    shards = {0: Counts(rows=2, prompt_tokens=10, completion_tokens=100, wall_seconds=4.0),
              1: Counts(rows=2, prompt_tokens=10, completion_tokens=60, wall_seconds=2.0)}
    manifest = Manifest({"model": "m", "drafter": None, "sampling": {}, "n": 1, "shard_rows": 2},
                        [{"path": "in.parquet"}], 2, shards, [], {0: 1_000_004.0, 1: 1_000_010.0})
    manifest.save(str(tmp_path))
    write_stats(str(tmp_path), shards, manifest.committed_at)
    (tmp_path / "_SUCCESS").write_bytes(b"")
    for shard in (0, 1):  # as `cp -r` leaves them: both at the copy's time
        write_parquet(tmp_path / f"part-{shard:05d}.parquet", {"error": [None, None]})
        os.utime(tmp_path / f"part-{shard:05d}.parquet", (2_000_000.0, 2_000_000.0))
    assert _report(str(tmp_path))[0] == 0
    report = (tmp_path / "report.md").read_text()
    # 0-4 s and 8-10 s: 160 tokens in 6 s (the part files' times would give 4 s)
    assert "| seconds in which any shard was generating | 6.000 |" in report
    assert "| output tokens/s | 26.7 |" in report
    assert "modification times" not in report and "missing" not in report
    assert "- 2 of 2 shards committed; complete (_SUCCESS written)" in report
    clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_000_010.0))
    assert f"| 1 | 2 | 0 | 60 | 2.000 | 30.0 | – | {clock} |" in report
    # without the manifest, stats.parquet's commit times give the same
    os.rename(tmp_path / "manifest.json", tmp_path / "manifest.bak")
    assert _report(str(tmp_path))[0] == 0
    assert "| seconds in which any shard was generating | 6.000 |" in (
        tmp_path / "report.md").read_text()
    os.rename(tmp_path / "manifest.bak", tmp_path / "manifest.json")
    os.remove(tmp_path / "part-00001.parquet")
    assert _report(str(tmp_path))[0] == 0
    report = (tmp_path / "report.md").read_text()
    assert ("- **missing part files** of committed shards: part-00001.parquet; their rows are "
            "not on disk (rerun the job's command to generate them again)") in report
    assert ("- 2 of 2 shards committed; was complete (_SUCCESS written), but part files are "
            "missing") in report


def test_damaged_part_files_are_named(tmp_path: Path) -> None:
    """A part file whose bytes are not the committed ones (its digest in the manifest), or, for
    a shard committed without a digest, whose footer cannot be read: the report said
    'complete' (a reviewer's truncated and zero-filled part files)."""
    manifest = Manifest({"model": "m", "drafter": None, "sampling": {}, "n": 1, "shard_rows": 2},
                        [{"path": "in.parquet"}], 3)
    for shard in range(3):
        write_parquet(tmp_path / f"part-{shard:05d}.parquet", {"error": [None, None]})
        manifest.commit(shard, Counts(rows=2, completion_tokens=10, wall_seconds=1.0),
                        str(tmp_path))
    del manifest.part_digests[2]  # as committed by a version that kept no digests
    manifest.save(str(tmp_path))
    write_stats(str(tmp_path), manifest.shards, manifest.committed_at)
    (tmp_path / "_SUCCESS").write_bytes(b"")
    assert _report(str(tmp_path))[0] == 0
    assert "damaged part files" not in (tmp_path / "report.md").read_text()
    for shard in (0, 2):
        part = tmp_path / f"part-{shard:05d}.parquet"
        data = bytearray(part.read_bytes())
        part.write_bytes(bytes(data[:50]) if shard == 2 else bytes(data[:8]) + b"\0" * 8
                         + bytes(data[16:]))
    assert _report(str(tmp_path))[0] == 0
    report = (tmp_path / "report.md").read_text()
    assert ("- **damaged part files** of committed shards: part-00000.parquet, part-00002.parquet; "
            "their bytes are not the ones committed (rerun the job's command to generate them "
            "again)") in report
    assert ("- 3 of 3 shards committed; was complete (_SUCCESS written), but part files are "
            "damaged") in report


def test_parallel_shards_count_their_time_once(tmp_path: Path) -> None:
    """Two workers' shards that generated at the same time: the job's rate is twice a
    shard's, where summing their seconds would give one worker's."""
    shards = {s: Counts(rows=4, prompt_tokens=20, completion_tokens=400, wall_seconds=10.0)
              for s in (0, 1)}
    Manifest({"model": "m", "drafter": None, "sampling": {}, "n": 1, "shard_rows": 4},
             [{"path": "in.parquet"}], 2, shards).save(str(tmp_path))
    write_stats(str(tmp_path), shards)
    for shard, mtime in ((0, 2_000_000.0), (1, 2_000_001.0)):
        part = tmp_path / f"part-{shard:05d}.parquet"
        write_parquet(part, {"error": [None, None, None, None]})
        os.utime(part, (mtime, mtime))
    assert _report(str(tmp_path))[0] == 0
    report = (tmp_path / "report.md").read_text()
    assert "| generation seconds (sum over shards) | 20.0 |" in report
    assert "| seconds in which any shard was generating | 11.0 |" in report
    assert "| output tokens/s | 72.7 |" in report  # 800 / 11
    assert "## Error rows by message" not in report  # no error rows
    assert "shards not committed yet" not in report


def test_a_job_with_no_shard_committed_yet(tmp_path: Path) -> None:
    Manifest({"model": "m", "drafter": None, "sampling": {}, "n": 1, "shard_rows": 4},
             [{"path": "in.parquet"}], 3, {}, [{"started": 2_000_000.0, "runner": "local"}]
             ).save(str(tmp_path))
    write_stats(str(tmp_path), {})
    assert _report(str(tmp_path))[0] == 0
    report = (tmp_path / "report.md").read_text()
    assert "- 0 of 3 shards committed; not complete" in report
    assert "- shards not committed yet: 0, 1, 2" in report
    assert "No shard is committed yet." in report
    assert "- throughput: not drawn (no shard committed yet)" in report


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


def test_the_report_names_every_sampling_option_the_job_set(
        tmp_path: Path, tiny_model_dir: Path, one_thread_module: None) -> None:
    inputs = write_parquet(tmp_path / "in.parquet", {"prompt": BENCH_PROMPTS[:2]})
    out = tmp_path / "job"
    generated = CliRunner().invoke(main, [
        "generate", str(inputs), str(out), "--model", str(tiny_model_dir), "--max-tokens", "4",
        "--temperature", "0.5", "--top-p", "0.9", "--min-p", "0.05", "--seed", "3",
        "--repetition-penalty", "1.2", "--presence-penalty", "-0.5", "--stop", "\n\n",
        "--logprobs", "--top-logprobs", "3", "--prompt-logprobs", "--output-prefix", "a_",
        "--kv-cache-memory", "16MiB"])
    assert generated.exit_code == 0, generated.output
    assert _report(str(out))[0] == 0
    report = (out / "report.md").read_text()
    assert ("\n- max_tokens 4, temperature 0.5, top_p 0.9, min_p 0.05, repetition_penalty 1.2, "
            "presence_penalty -0.5, seed 3, stop '\\n\\n', n 1, 10000 rows per shard, 1 input "
            "file(s)\n") in report
    assert ("; the job's columns `a_completion`, ... (`--output-prefix a_`) with "
            "`a_completion_logprobs` (`--logprobs`), `a_completion_top_logprobs` "
            "(`--top-logprobs 3`) and `a_prompt_logprobs` (`--prompt-logprobs`)\n") in report
