"""The job's progress bar: its tokens/s shows while a long row is still generating, and the prompt
tokens/s of the rows finished beside it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import pipeline.progress as progress
from pipeline.config import JobConfig
from pipeline.job import run_job
from runtime.config import EngineConfig
from runtime.engine import Engine
from tests.pipeline.helpers import read_parts, write_parquet


def test_the_rate_is_drawn_before_any_row_finishes(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """One prompt with --n 100000: no row finishes for minutes, and the bar stood still."""
    clock = iter([0.0, 1.0, 2.0, 3.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = progress.Progress(1, 0)  # start: 0.0
    capsys.readouterr()
    bar.tokens_generated(50)  # at 1.0: 50 tokens in 1 s
    assert "50.0 tok/s" in capsys.readouterr().err
    bar.tokens_generated(50)  # at 2.0
    assert "50.0 tok/s" in capsys.readouterr().err
    bar.close()  # at 3.0: the last line has the whole run's rate
    assert capsys.readouterr().err.rstrip().endswith("33.3 tok/s]")


def test_into_a_log_file_the_bar_is_drawn_every_30_seconds(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A scheduled job's stderr is a file: redraws twice a second filled its log (megabytes of
    them over a long job). Rows finishing and tokens arriving draw it on one clock."""
    clock = iter([0.0, 1.0, 2.0, 29.0, 31.0, 40.0, 45.0, 61.5, 80.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    bar = progress.Progress(10, 0)  # start: 0.0
    capsys.readouterr()
    drawn = []
    for i in range(7):  # at 1, 2, 29, 31, 40, 45 and 61.5 s: rows and tokens in turn
        if i % 2:
            bar.rows_done(1)
        else:
            bar.tokens_generated(10)
        err = capsys.readouterr().err
        assert "\r" not in err and err.count("\n") == err.count("row")
        drawn.append(err.count("row"))
    assert drawn == [1, 0, 0, 1, 0, 0, 1]  # the first, then 30 s after the last drawing
    bar.close()  # at 80 s: one last line, with the rate of the whole run (40 tokens)
    # a line of its own each time (tqdm's "\r" redraws made one line of a whole job's log)
    assert capsys.readouterr().err == (" 30%|███       | 3/10 [01:20<03:06, 26.67s/row, in 0.0, "
                                       "out 0.5 tok/s]\n")


def test_a_jobs_rows_bring_their_prompt_tokens_to_the_bar(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path,
        tiny_engine: Engine) -> None:
    """The bar's input rate counts each finished row's prompt tokens once a sample that did not
    fail (as stats.parquet's prompt_tokens): a row as its last sample finishes, error rows at
    none, so that a scoring job (--max-tokens 1) shows what it scores."""
    calls: list[tuple[int, int]] = []

    class Recording(progress.Progress):
        def rows_done(self, count: int, prompt_tokens: int = 0) -> None:
            calls.append((count, prompt_tokens))
            super().rows_done(count, prompt_tokens)

    monkeypatch.setattr("pipeline.job.Progress", Recording)
    write_parquet(tmp_path / "in.parquet",
                  {"prompt": ["Paris is the capital of", None, "Once upon a time", "Berlin"]})
    config = JobConfig(input=str(tmp_path / "in.parquet"), output_dir=str(tmp_path / "out"),
                       engine=EngineConfig(model=str(tiny_model_dir), kv_cache_memory=16 << 20),
                       shard_rows=2, max_tokens=3, n=2)
    summary = run_job(config, lambda _: tiny_engine, progress=False)
    rows = read_parts(tmp_path / "out").to_pylist()
    lengths = [rows[i]["prompt_tokens"] for i in (0, 4, 6)]  # the first sample of each prompt
    assert [r["prompt_tokens"] for r in rows] == [lengths[0]] * 2 + [None] * 2 + [
        lengths[1]] * 2 + [lengths[2]] * 2
    # shard 0: its error row before generating, then row 0 (2 samples); shard 1: rows 2 and 3
    # in the order they finish
    assert calls[:2] == [(1, 0), (1, 2 * lengths[0])]
    assert sorted(calls[2:]) == sorted([(0, 0), (1, 2 * lengths[1]), (1, 2 * lengths[2])])
    assert sum(p for _, p in calls) == summary.totals.prompt_tokens == 2 * sum(lengths)
