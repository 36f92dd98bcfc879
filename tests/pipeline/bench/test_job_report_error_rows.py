"""The job report's error rows by message: messages that differ only in their numbers counted
together, read before the optional columns; bar plots' labels."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench.job_errors import error_reasons
from pipeline.bench.plots import _label_step
from pipeline.stats import Counts
from tests.pipeline.helpers import write_parquet


def test_error_messages_that_differ_only_in_numbers_are_counted_together(
        tmp_path: Path) -> None:
    """14 too-long prompts made ten rows of count 1 (each its own token count) and '4 other
    messages not listed'."""
    long = "prompt has {} tokens; the model's context is 64"
    write_parquet(tmp_path / "part-00000.parquet",
                  {"error": [long.format(91), long.format(94), "prompt is empty",
                             "stop string 2 is not valid UTF-8", None]})
    report = error_reasons(str(tmp_path), {0: Counts(rows=5, errors=4)})
    assert report == (
        "## Error rows by message\n\n| error rows | error |\n| ---: | --- |\n"
        "| 2 | `prompt has N tokens; the model's context is 64` |\n"  # 64 on both
        "| 1 | `prompt is empty` |\n"
        "| 1 | `stop string 2 is not valid UTF-8` |\n\n"  # alone: as written
        "(N: a number; messages that differ only in their numbers are counted together)")


@pytest.mark.parametrize("prefix", ["", "y_"])
def test_error_messages_are_read_before_the_optional_columns(tmp_path: Path, prefix: str) -> None:
    """Found by a reviewer: with --logprobs, --top-logprobs or --prompt-logprobs the error
    column is not a part file's last, and the report said the part file could not be read."""
    earlier = {"error": ["an earlier job's", None, None]} if prefix else {}  # an input column
    write_parquet(tmp_path / "part-00000.parquet", {
        **earlier, f"{prefix}error": [None, "prompt is empty", None],
        f"{prefix}completion_logprobs": [None, None, [-0.5]],
        f"{prefix}prompt_logprobs": [None, None, [None, -1.0]]})
    report = error_reasons(str(tmp_path), {0: Counts(rows=3, errors=1)})
    assert report == ("## Error rows by message\n\n| error rows | error |\n| ---: | --- |\n"
                      "| 1 | `prompt is empty` |")


def test_error_messages_keep_a_letter_n_and_numbers_that_do_not_differ(tmp_path: Path) -> None:
    """N stands only for numbers that differ within a group: a message's own capital N and the
    numbers its rows share stay as written."""
    write_parquet(tmp_path / "part-00000.parquet",
                  {"error": ["row 3: Not a number: NaN in 2 of 7",
                             "row 12: Not a number: NaN in 2 of 9",
                             "row 3: Not a number: NaN in 2 of 7"]})
    report = error_reasons(str(tmp_path), {0: Counts(rows=3, errors=3)})
    assert "| 3 | `row N: Not a number: NaN in 2 of N` |" in report


def test_error_messages_with_negative_numbers_are_counted_with_the_others(
        tmp_path: Path) -> None:
    """-0.1 and 1.5 made two groups ('got -N', 'got N'); the dash of a range is no sign."""
    write_parquet(tmp_path / "part-00000.parquet",
                  {"error": ["top_p got -0.1", "top_p got 1.5", "top_p got -2",
                             "rows 10-19 unreadable", "rows 20-29 unreadable"]})
    report = error_reasons(str(tmp_path), {0: Counts(rows=5, errors=5)})
    assert "| 3 | `top_p got N` |\n| 2 | `rows N-N unreadable` |" in report


def test_error_messages_with_a_letter_n_or_exponents_are_grouped_by_their_numbers(
        tmp_path: Path) -> None:
    """'(N)' and '(5)' made one pattern of 1 and 2 numbers: report stopped on a ValueError;
    '-3e-05' was a group of its own ('got Ne-N')."""
    write_parquet(tmp_path / "part-00000.parquet",
                  {"error": ["messages[0] (N) has null content", "messages[0] (5) has null content",
                             "got -0.5", "got -3e-05", "got 2E+7"]})
    report = error_reasons(str(tmp_path), {0: Counts(rows=5, errors=5)})
    assert "| 3 | `got N` |" in report
    assert "| 1 | `messages[0] (N) has null content` |" in report
    assert "| 1 | `messages[0] (5) has null content` |" in report


def test_bar_plots_label_a_round_step_of_bars_that_fits() -> None:
    """470 shards were labelled every 23rd, the labels running together ('115138161...')."""
    assert [_label_step(n, len(str(n - 1))) for n in (5, 20, 30, 470, 3000, 100_000)] == [
        1, 1, 2, 50, 250, 10_000]
