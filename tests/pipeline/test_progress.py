"""The job's progress bar: its tokens/s shows while a long row is still generating."""

from __future__ import annotations

import sys

import pytest

import pipeline.progress as progress


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
    assert capsys.readouterr().err == " 30%|███       | 3/10 [01:20<03:06, 26.67s/row, 0.5 tok/s]\n"
