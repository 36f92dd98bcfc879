"""`eaglebatch generate` interrupted: SIGINT, SIGKILL and SIGTERM while it imports, starts,
runs or has just finished, each a message (or exit 0 once complete), and a rerun that resumes
to the output of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobs.cli import main
from tests.jobs.generate_cases import PROMPTS, _generate
from tests.pipeline.helpers import hidden_files, read_parts, write_parquet

REPO = Path(__file__).resolve().parents[2]


def _start(model_dir: Path, input_path: Path, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "jobs", "generate", str(input_path), str(out), "--model",
         str(model_dir), "--kv-cache-memory", "16MiB", "--shard-rows", "1", "--max-tokens", "24"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_shards(out: Path, more_than: int, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            done = len(json.loads((out / "manifest.json").read_text())["shards"])
        except (OSError, ValueError):
            done = 0
        if done > more_than:
            return done
        time.sleep(0.02)
    raise AssertionError("no shard committed in time")


def test_sigint_then_sigkill_then_resume_gives_every_row_once_as_uninterrupted(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS] * 2  # 42 rows, 42 shards
    path = write_parquet(tmp_path / "in.parquet",
                         {"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts})
    out = tmp_path / "out"
    proc = _start(tiny_model_dir, path, out)
    _wait_for_shards(out, 0, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.decode().rstrip().endswith("interrupted; rerun the same command to resume")
    assert not (out / "_SUCCESS").exists()

    proc = _start(tiny_model_dir, path, out)
    done = _wait_for_shards(out, 1, proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait(timeout=60)
    assert done < len(prompts) and not (out / "_SUCCESS").exists()

    result = CliRunner().invoke(main, ["generate", str(path), str(out), "--model",
                                       str(tiny_model_dir), "--kv-cache-memory", "16MiB",
                                       "--shard-rows", "1", "--max-tokens", "24"])
    assert result.exit_code == 0, result.output
    assert hidden_files(out) == [] and (out / "_SUCCESS").exists()
    table = read_parts(out)
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(len(prompts))]
    reference = _generate(tiny_model_dir, path, tmp_path / "ref", "--shard-rows", "7",
                          "--max-tokens", "24")
    assert reference.exit_code == 0
    assert table.equals(read_parts(tmp_path / "ref"))


@pytest.mark.parametrize("overwrite", [False, True])
def test_ctrl_c_while_the_job_starts_is_a_message_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool) -> None:
    """Before the job's own SIGINT handler is in place (reading inputs, loading the model)."""
    import pipeline.job

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.job, "run_job", interrupted)
    inputs = write_parquet(tmp_path / "in.parquet", {"prompt": ["hi"]})
    result = CliRunner().invoke(main, ["generate", str(inputs), str(tmp_path / "out"),
                                       *(["--overwrite"] if overwrite else [])])
    assert result.exit_code == 128 + signal.SIGINT
    hint = ("rerun the same command without --overwrite to resume (with it, the job starts "
            "over)" if overwrite else "rerun the same command to resume")
    assert result.stderr == f"interrupted; the shards committed so far are kept: {hint}\n"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_imports_is_a_message(tmp_path: Path, tiny_model_dir: Path,
                                                         signum: int) -> None:
    """The first seconds go to importing torch and transformers, before any command runs."""
    inputs = write_parquet(tmp_path / "in.parquet", {"prompt": ["hi"]})
    proc = _start(tiny_model_dir, inputs, tmp_path / "out")
    time.sleep(0.5)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    # half a second in, a 2-core machine is still importing; a fast one may be loading the model
    assert err.decode() in ("interrupted while starting, before anything was done: rerun the "
                            "same command\n", "interrupted; the shards committed so far are "
                            "kept: rerun the same command to resume\n")
    assert not (tmp_path / "out").exists()


def test_sigterm_while_the_job_starts_is_a_message_not_a_kill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the job's own handlers (reading inputs, loading the model), SIGTERM killed the
    process without a word; now it says how to resume."""
    import pipeline.job

    def terminated(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(pipeline.job, "run_job", terminated)
    inputs = write_parquet(tmp_path / "in.parquet", {"prompt": ["hi"]})
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(main, ["generate", str(inputs), str(tmp_path / "out")])
    assert result.exit_code == 128 + signal.SIGTERM
    assert result.stderr == ("interrupted; the shards committed so far are kept: rerun the same "
                             "command to resume\n")
    assert before is not signal.SIG_IGN
    # a second signal while the process exits is ignored (Ctrl-C raised in objects' __del__,
    # SIGTERM killed it after the message)
    assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_once_success_is_written_leaves_exit_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: int) -> None:
    """Between writing _SUCCESS and returning (the shards' handlers gone, the command's own not
    yet ignoring), a soak's SIGTERM gave exit 143 and 'interrupted' on a complete job."""
    import pipeline.job
    from pipeline.stats import Counts

    out = tmp_path / "out"

    def complete_then_signalled(config: object) -> pipeline.job.JobSummary:
        out.mkdir()
        (out / "_SUCCESS").write_bytes(b"")
        os.kill(os.getpid(), signum)
        return pipeline.job.JobSummary(Counts(rows=1), 1, 0, 1, True)

    monkeypatch.setattr(pipeline.job, "run_job", complete_then_signalled)
    inputs = write_parquet(tmp_path / "in.parquet", {"prompt": ["hi"]})
    result = CliRunner().invoke(main, ["generate", str(inputs), str(out), "--drafter", "none"])
    assert (result.exit_code, result.stderr) == (0, "")
