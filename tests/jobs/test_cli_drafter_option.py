"""--drafter auto where the shipped drafter is not installed (a wheel built without drafters/)."""

from __future__ import annotations

import pytest

import jobs.cli as cli
from runtime.config import DEFAULT_MODEL


def test_auto_says_so_where_the_shipped_drafter_is_missing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "default_drafter", lambda model: None)
    assert cli._drafter(DEFAULT_MODEL, "auto") is None
    assert capsys.readouterr().err == (
        f"note: the drafter shipped for {DEFAULT_MODEL} is not installed (it is read from the "
        "source tree: install with pip install -e .); decoding without one\n")
    # a model for which none ships: nothing to say
    assert cli._drafter("some/model", "auto") is None
    assert capsys.readouterr().err == ""
