"""The job's progress bar: its tokens/s shows while a long row is still generating."""

from __future__ import annotations

import pytest

import pipeline.progress as progress


def test_the_rate_is_drawn_before_any_row_finishes(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """One prompt with --n 100000: no row finishes for minutes, and the bar stood still."""
    clock = iter([0.0, 1.0, 2.0, 3.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    bar = progress.Progress(1, 0)  # start: 0.0
    capsys.readouterr()
    bar.tokens_generated(50)  # at 1.0: 50 tokens in 1 s
    assert "50.0 tok/s" in capsys.readouterr().err
    bar.close()
