"""What `bench` and `report` leave on disk and say when something is wrong: no stale plots
beside a report that did not draw them, no empty --out after a refusal, one-line errors for
damaged or foreign files, impossible devices and a missing directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from jobs.cli import main
from pipeline.bench.bench_file import read_bench_parquet
from pipeline.manifest import Manifest
from pipeline.stats import Counts, write_stats
from tests.pipeline.bench.conftest import run_bench_cli
from tests.pipeline.helpers import write_parquet

SPEEDUP, ACCEPTANCE = "speedup_by_k.png", "acceptance_by_position.png"


def _report(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["report", *args])
    return result.exit_code, result.stdout, result.stderr


def test_a_later_bench_without_drafts_leaves_no_plots_of_the_earlier_one(
        bench_dir: Path, tiny_model_dir: Path, prompts_file: Path, tmp_path: Path,
        one_thread_module: None) -> None:
    out = tmp_path / "again"
    shutil.copytree(bench_dir, out)
    assert (out / SPEEDUP).is_file() and (out / ACCEPTANCE).is_file()
    args = ("--model", str(tiny_model_dir), "--prompts", str(prompts_file), "--out", str(out),
            "--batch-sizes", "2", "--k", "0", "--repeats", "1", "--max-tokens", "2",
            "--baseline", "none")
    # not without --overwrite: it was replaced without a word (a kill then left neither)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    result = run_bench_cli(*args)
    assert (result.exit_code, result.stderr) == (
        2, f"error: --out {out} holds an earlier bench's bench.parquet: pass --overwrite to "
           "replace it and its report, or pick another directory\n")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before
    result = run_bench_cli(*args, "--overwrite")
    assert result.exit_code == 0, result.output
    report = (out / "report.md").read_text()
    assert "- speedup: not drawn" in report and "- acceptance: not drawn" in report
    assert not (out / SPEEDUP).exists() and not (out / ACCEPTANCE).exists()
    assert (out / "tokens_per_s_by_batch.png").is_file()
    # the header speaks of what ran: no batch-1 turns, no drafter settings
    assert "request by request" not in report and "drafter confidence" not in report


def test_a_refused_bench_leaves_no_out_directory(tiny_model_dir: Path, prompts_file: Path,
                                                 tmp_path: Path) -> None:
    out = tmp_path / "never"
    missing = tmp_path / "missing.parquet"
    result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(missing),
                           "--out", str(out), "--k", "0")
    assert result.exit_code == 2 and result.stderr.startswith(f"error: --prompts {missing}: ")
    assert not out.exists()
    result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                           "--out", str(out), "--k", "0", "--device", "cpu",
                           "--attention-backend", "flash")
    assert (result.exit_code, result.stderr) == (
        2, "error: --attention-backend flash needs CUDA and the flash-attn package "
           "(pip install -e .[gpu])\n")
    assert not out.exists()
    # refused as the option it is, before the model loads (it was "cannot load --model ...")
    result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                           "--out", str(out), "--k", "0", "--device", "cpu", "--cuda-graphs")
    assert (result.exit_code, result.stderr) == (
        2, "error: --cuda-graphs needs a CUDA device (this engine runs on cpu)\n")
    assert not out.exists()


def test_report_refuses_damaged_and_foreign_bench_files_and_out_files(
        bench_dir: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "bench.parquet").write_text("junk")
    code, _, stderr = _report(str(damaged))
    assert code == 2
    assert stderr.startswith(f"error: {damaged / 'bench.parquet'}: cannot read it as a bench's "
                             "Parquet file (")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    write_stats(str(foreign), {0: Counts(rows=1)})
    shutil.move(foreign / "stats.parquet", foreign / "bench.parquet")
    code, _, stderr = _report(str(foreign))
    assert (code, stderr) == (2, f"error: {foreign / 'bench.parquet'} lacks the column(s) "
                                 "order, repeat, batch_size, variant, k: not the bench.parquet of "
                                 "an eaglebatch bench\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    code, _, stderr = _report(str(bench_dir), "--out", str(a_file))
    assert (code, stderr) == (2, f"error: --out {a_file}: cannot make it a directory (File "
                                 "exists)\n")
    code, _, stderr = _report(str(tmp_path / "nowhere"))
    assert (code, stderr) == (2, f"error: OUTPUT_DIR {tmp_path / 'nowhere'}: no such "
                                 "directory\n")
    # an --out holding another job's or bench's files: its report would be replaced
    (foreign / "bench.parquet").unlink()
    write_stats(str(foreign), {0: Counts(rows=1)})
    for other, held in ((foreign, "stats.parquet"), (bench_dir, "bench.parquet")):
        code, _, stderr = _report(str(damaged), "--out", str(other))
        assert (code, stderr) == (2, f"error: --out {other} holds {held} of another job or "
                                     "bench: the report written there would replace its own; "
                                     "pick another directory\n")
    assert sorted(p.name for p in foreign.iterdir()) == ["stats.parquet"]
    # an --out holding the report of another job or bench (or a report.md of the user's)
    shared = tmp_path / "reports"
    assert _report(str(bench_dir), "--out", str(shared))[0] == 0
    assert _report(str(bench_dir), "--out", str(shared))[0] == 0  # its own: redrawn
    job = tmp_path / "job"
    job.mkdir()
    write_stats(str(job), {0: Counts(rows=1)})
    code, _, stderr = _report(str(job), "--out", str(shared))
    assert (code, stderr) == (2, f"error: --out {shared} holds a report.md that is not a report "
                                 f"of {job}: pick another directory, or remove it\n")
    assert "# eaglebatch bench" in (shared / "report.md").read_text()


def test_a_job_report_with_a_damaged_manifest_comes_from_stats_parquet(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    shards = {0: Counts(rows=4, errors=1, prompt_tokens=20, completion_tokens=30,
                        wall_seconds=1.5)}
    Manifest({"model": "m"}, [], 2, shards).save(str(job))
    write_stats(str(job), shards)
    (job / "manifest.json").write_text("{")
    code, _, stderr = _report(str(job))
    assert code == 0, stderr
    assert stderr.startswith(f"{job / 'manifest.json'} is damaged (")
    assert stderr.endswith("); reporting from stats.parquet alone\n")
    assert "| rows | 4 |" in (job / "report.md").read_text()
    assert "- a damaged manifest.json: figures come from stats.parquet only" in (
        job / "report.md").read_text()
    (job / "stats.parquet").unlink()
    code, _, stderr = _report(str(job))
    assert code == 2 and stderr.endswith("), and there is no stats.parquet to report from\n")
    assert "--overwrite" not in stderr


def test_bench_reads_chat_messages_as_generate_does(tiny_model_dir: Path, tmp_path: Path,
                                                    one_thread_module: None) -> None:
    """--messages-column: the same prompt ids as the prompt column's one-message chats."""
    texts = ["The sky is", "Bread needs"]
    messages = [[{"role": "user", "content": t}] for t in texts]
    path = write_parquet(tmp_path / "chats.parquet", {"prompt": texts, "messages": messages})
    reports = {}
    for name, column in (("by-prompt", ()), ("by-messages", ("--messages-column", "messages"))):
        out = tmp_path / name
        result = CliRunner().invoke(main, [
            "bench", "--model", str(tiny_model_dir), "--prompts", str(path), "--out", str(out),
            *column, "--batch-sizes", "2", "--k", "0", "--max-tokens", "3", "--repeats", "1",
            "--baseline", "none"])
        assert result.exit_code == 0, result.output
        rows, meta = read_bench_parquet(out / "bench.parquet")
        reports[name] = (meta["prompts"], meta["prompt_tokens"], rows[0]["output_tokens"])
    assert reports["by-messages"] == reports["by-prompt"]
    assert reports["by-messages"][0] == 2
    # the header says how the prompts became tokens
    assert ("EOS ends a request; messages rendered with the model's chat template\n"
            in (tmp_path / "by-messages" / "report.md").read_text())
    assert ("EOS ends a request; prompts as the user message of the model's chat template\n"
            in (tmp_path / "by-prompt" / "report.md").read_text())
    quick = ("--batch-sizes", "2", "--k", "0", "--max-tokens", "3", "--repeats", "1",
             "--baseline", "none")

    def bench(model: Path, out: str, *args: str) -> Any:
        return CliRunner().invoke(main, ["bench", "--model", str(model), "--prompts", str(path),
                                         "--out", str(tmp_path / out), *quick, *args])

    # as `generate` refuses it (bench ignored --no-chat-template)
    result = bench(tiny_model_dir, "x", "--messages-column", "messages", "--no-chat-template")
    assert (result.exit_code, result.stderr) == (
        2, "error: --messages-column needs the chat template; drop --no-chat-template\n")
    result = bench(tiny_model_dir, "raw", "--no-chat-template")
    assert result.exit_code == 0, result.output
    assert ("; prompts tokenized as raw text (`--no-chat-template`)\n"
            in (tmp_path / "raw" / "report.md").read_text())
    # a model whose tokenizer has no chat template (it said no prompt could be tokenized)
    plain = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((plain / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    result = bench(plain, "x", "--messages-column", "messages")
    assert (result.exit_code, result.stderr) == (
        2, "error: --messages-column messages: the model's tokenizer has no chat template to "
           "render messages with\n")
    result = bench(plain, "plain")
    assert result.exit_code == 0, result.output
    assert ("; prompts tokenized as raw text: the model's tokenizer has no chat template\n"
            in (tmp_path / "plain" / "report.md").read_text())
    result = CliRunner().invoke(main, ["bench", "--model", str(tiny_model_dir), "--prompts",
                                       str(path), "--out", str(tmp_path / "x"),
                                       "--prompt-column", "messages"])
    assert result.exit_code == 2
    assert result.stderr == (f"error: --prompts {path}: column 'messages' is "
                             "list<element: struct<role: string, content: string>>, expected "
                             "string (--prompt-column) (chat messages: --messages-column)\n")


def test_bench_and_job_directories_do_not_take_each_others_reports(
        bench_dir: Path, tiny_model_dir: Path, prompts_file: Path, tmp_path: Path) -> None:
    """bench replaced a report.md it had not written; a job ran in a bench's directory, whose
    report then replaced the bench's."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                           "--out", str(mine), "--k", "0", "--batch-sizes", "1")
    assert (result.exit_code, result.stderr) == (
        2, f"error: --out {mine} holds a report.md: pass --overwrite to replace it, or pick "
           "another directory\n")
    assert sorted(p.name for p in mine.iterdir()) == ["report.md"]
    assert (mine / "report.md").read_text() == "my notes"
    benched = tmp_path / "benched"
    shutil.copytree(bench_dir, benched)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in benched.iterdir())
    result = CliRunner().invoke(main, ["generate", str(prompts_file), str(benched), "--model",
                                       str(tiny_model_dir), "--max-tokens", "2"])
    assert (result.exit_code, result.stderr) == (
        2, f"error: OUTPUT_DIR {benched} holds a bench's bench.parquet: the job's report would "
           "replace the bench's report.md; choose another OUTPUT_DIR\n")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in benched.iterdir()) == before


def test_a_hand_edited_bench_file_or_one_beside_a_job_is_a_one_line_error(
        bench_dir: Path, tmp_path: Path) -> None:
    """Found by QA: metadata that is not an object, a null k or an unknown variant gave
    tracebacks; a bench.parquet in a job's directory replaced the job's report.md."""
    from pipeline.bench.bench_file import write_bench_parquet

    rows, meta = read_bench_parquet(bench_dir / "bench.parquet")
    for name, (edited_rows, edited_meta) in {
            "list-meta": (rows, ["not", "an", "object"]),
            "null-k": ([{**r, "k": None} for r in rows], meta),
            "variant": ([{**r, "variant": "mystery"} for r in rows], meta)}.items():
        edited = tmp_path / name
        edited.mkdir()
        write_bench_parquet(edited / "bench.parquet", edited_rows, edited_meta)  # type: ignore[arg-type]
        code, _, stderr = _report(str(edited))
        assert code == 2, (name, stderr)
        assert stderr.startswith(f"error: {edited / 'bench.parquet'}: not a bench this version "
                                 "can read ("), (name, stderr)
        assert len(stderr.splitlines()) == 1
    job = tmp_path / "job"
    job.mkdir()
    write_stats(str(job), {0: Counts(rows=1)})
    shutil.copy(bench_dir / "bench.parquet", job)
    code, _, stderr = _report(str(job))
    assert (code, stderr) == (2, f"error: {job} holds both a bench's bench.parquet and a job's "
                                 "stats.parquet: move the bench's out to report on either\n")


def test_a_blank_out_and_a_second_bench_into_the_same_out_are_refused(
        tiny_model_dir: Path, prompts_file: Path, tmp_path: Path,
        monkeypatch: Any) -> None:
    import fcntl

    monkeypatch.chdir(tmp_path)
    for args in (["--out", " "], ["--out", ""]):
        result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                               "--k", "0", *args)
        assert result.exit_code == 2
        assert "Invalid value for '--out'" in result.output
    result = CliRunner().invoke(main, ["report", str(tmp_path), "--out", ""])
    assert result.exit_code == 2 and "Invalid value for '--out'" in result.output
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "busy"
    out.mkdir()
    with open(out / ".eaglebatch-bench.lock", "a") as held:  # a bench running there
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = run_bench_cli("--model", str(tiny_model_dir), "--prompts", str(prompts_file),
                               "--out", str(out), "--k", "0")
    assert (result.exit_code, result.stderr) == (
        2, f"error: --out {out}: another bench is writing there\n")
    assert sorted(p.name for p in out.iterdir()) == [".eaglebatch-bench.lock"]
