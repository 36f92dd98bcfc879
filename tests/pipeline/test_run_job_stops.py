"""run_job stopped or refused: SIGINT abandons the shard in flight and a resume completes,
signals during the manifest's last save lose no shard, a job refused for the lock or at its
model leaves the folders of others and none of its own."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline import manifest as manifest_module
from pipeline.config import JobError
from pipeline.interrupt import JobInterrupted
from pipeline.job import run_job
from pipeline.manifest import Manifest
from runtime.engine import Engine
from runtime.request import Completion, GenerationRequest
from tests.pipeline.helpers import hidden_files, read_parts
from tests.pipeline.job_cases import _config, _factory, _inputs


class _SignalDuringShard:
    """The real engine, plus a SIGINT sent to this process when shard `at` starts generating."""

    def __init__(self, engine: Engine, at: int) -> None:
        self.engine, self.at, self.calls = engine, at, 0
        self.tokenizer, self.eos_token_ids = engine.tokenizer, engine.eos_token_ids
        self.max_model_len, self.model_name = engine.max_model_len, engine.model_name
        self.unapplied_generation_config = engine.unapplied_generation_config
        self.model_context = engine.model_context
        self.vocab_size = engine.vocab_size

    def generate(self, requests: Iterable[GenerationRequest],
                 on_step: Callable[[int], None] | None = None) -> Iterator[Completion]:
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        self.calls += 1
        yield from self.engine.generate(requests, on_step)


def test_sigint_abandons_the_shard_in_flight_and_resume_completes(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    _inputs(tmp_path)
    reference = _config(tmp_path, tiny_model_dir, out="reference")
    run_job(reference, _factory(tiny_engine), progress=False)
    config = _config(tmp_path, tiny_model_dir)
    fresh = Engine(config.engine)  # left mid-generation by the interrupt; not reused
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the runner started in background
    with pytest.raises(JobInterrupted) as err:
        run_job(config, _factory(_SignalDuringShard(fresh, at=1)), progress=False)  # type: ignore[arg-type]
    assert err.value.signum == signal.SIGINT
    assert str(err.value) == "interrupted; rerun the same command to resume"
    assert signal.getsignal(signal.SIGINT) is before  # the job's handler is gone again
    out = tmp_path / "out"
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == [
        "manifest.json", "part-00000.parquet", "stats.parquet"]
    assert hidden_files(out) == []
    assert list(json.loads((out / "manifest.json").read_text())["shards"]) == ["0"]
    summary = run_job(config, _factory(tiny_engine), progress=False)
    assert (summary.shards_resumed, summary.complete) == (1, True)
    assert read_parts(out).equals(read_parts(tmp_path / "reference"))
    # a job started with --overwrite would start over if rerun as it was: the message says so
    again = Engine(config.engine)
    with pytest.raises(JobInterrupted) as err:
        run_job(_config(tmp_path, tiny_model_dir, overwrite=True),
                _factory(_SignalDuringShard(again, at=1)), progress=False)  # type: ignore[arg-type]
    assert str(err.value) == ("interrupted; rerun the same command without --overwrite to "
                              "resume (with it, the job starts over)")


def test_signals_during_the_last_save_of_the_manifest_do_not_lose_shards(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest's last save (every shard since the one before) ran after the job's signal
    handlers were gone, and a second Ctrl-C stopped it at once: its temporary file was thrown
    away, and shards already written were generated again on resume."""
    _inputs(tmp_path)
    monkeypatch.setattr(manifest_module, "SAVE_SPACING", 1e9)  # saved at shard 0, then at the end
    save = Manifest.save

    def interrupted_save(self: Manifest, output_dir: str) -> None:
        if self.complete:  # the last save: Ctrl-C twice while it writes
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        save(self, output_dir)
    monkeypatch.setattr(Manifest, "save", interrupted_save)
    config = _config(tmp_path, tiny_model_dir)
    summary = run_job(config, _factory(tiny_engine), progress=False)
    assert summary.complete  # every shard was written: the job is done
    out = tmp_path / "out"
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) == 5
    assert (out / "_SUCCESS").exists() and hidden_files(out) == []


def test_a_job_refused_for_the_lock_leaves_the_holders_directory(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs started at once on a new OUTPUT_DIR: the one that created it but lost the lock
    is refused, and must not remove the directory and lock file of the one that holds it."""
    import fcntl

    import pipeline.job as job_module

    _inputs(tmp_path)
    out = tmp_path / "out"
    holder: list[Any] = []
    real_makedirs = os.makedirs

    def makedirs_then_lose_the_race(path: str, exist_ok: bool = False) -> None:
        real_makedirs(path, exist_ok=exist_ok)
        lock = open(os.path.join(path, ".eaglebatch.lock"), "a")  # noqa: SIM115
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other job takes it first
        holder.append(lock)

    monkeypatch.setattr(job_module.os, "makedirs", makedirs_then_lose_the_race)
    with pytest.raises(JobError, match=f"^another eaglebatch job is writing to {out}$"):
        run_job(_config(tmp_path, tiny_model_dir), _factory(tiny_engine), progress=False)
    assert os.listdir(out) == [".eaglebatch.lock"]
    holder[0].close()


def test_a_refused_job_leaves_none_of_the_folders_it_made(tmp_path: Path) -> None:
    """OUTPUT_DIR's parents that the job made for it go too, not those that were there."""
    _inputs(tmp_path)
    (tmp_path / "keep").mkdir()
    for out in ("nest/a/b", "keep/x/y"):
        with pytest.raises(JobError, match="^cannot load --model "):
            run_job(_config(tmp_path, tmp_path / "no-model", out=out), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["in", "keep"]
    assert os.listdir(tmp_path / "keep") == []
