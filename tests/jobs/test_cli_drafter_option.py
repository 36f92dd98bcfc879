"""--drafter auto where the shipped drafter is not installed (a wheel built without drafters/);
blank --model and --drafter values."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import jobs.generate_config as generate_config
from jobs.cli import main
from runtime.config import DEFAULT_MODEL

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_auto_says_so_where_the_shipped_drafter_is_missing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(generate_config, "default_drafter", lambda model: None)
    assert generate_config.drafter_path(DEFAULT_MODEL, "auto") is None
    assert capsys.readouterr().err == (
        f"note: the drafter shipped for {DEFAULT_MODEL} is not installed (it is read from the "
        "source tree: install with pip install -e .); decoding without one\n")
    # a model for which none ships: nothing to say
    assert generate_config.drafter_path("some/model", "auto") is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command, option", [
    (["generate", "examples/prompts.parquet", "out"], "--drafter"),
    (["generate", "examples/prompts.parquet", "out"], "--model"),
    (["bench", "--prompts", "examples/prompts.parquet", "--out", "report"], "--model"),
    (["bench", "--prompts", "examples/prompts.parquet", "--out", "report"], "--drafter"),
    (["train-drafter", "--prompts", "examples/prompts.parquet", "--out", "data"], "--model"),
])
def test_a_blank_model_or_drafter_is_refused_as_such(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], option: str) -> None:
    """'' would be read as the current directory (a drafter) or a model named ''."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLES / "prompts.parquet", tmp_path / "examples")
    result = CliRunner().invoke(main, [*command, option, " "])
    assert result.exit_code == 2
    assert f"Invalid value for '{option}': ' ' is blank: give a name or a path" in result.output
    assert sorted(os.listdir(tmp_path)) == ["examples"]  # nothing written


@pytest.mark.parametrize("args, message", [
    (["--temperature", "1", "--top-k", "99999999999999999999"],
     "Invalid value for '--top-k': 99999999999999999999 is not in the range 0<=x<=2147483647."),
    (["--draft-confidence", "nan"], "Invalid value for '--draft-confidence': nan is not a finite "
                                    "number"),
    (["--temperature", "nan"], "Invalid value for '--temperature': nan is not a finite number"),
    (["--temperature", "inf"], "Invalid value for '--temperature': inf is not a finite number"),
    (["--top-p", "nan"], "Invalid value for '--top-p': nan is not a finite number"),
    (["--min-p", "1.5"], "Invalid value for '--min-p': 1.5 is not in the range 0<=x<=1."),
    (["--repetition-penalty", "1e-38"],
     "Invalid value for '--repetition-penalty': 1e-38 is not in the range 0.01<=x<=100.0."),
    (["--repetition-penalty", "0"],
     "Invalid value for '--repetition-penalty': 0.0 is not in the range 0.01<=x<=100.0."),
    (["--presence-penalty", "nan"],
     "Invalid value for '--presence-penalty': nan is not a finite number"),
    (["--frequency-penalty", "-2.5"],
     "Invalid value for '--frequency-penalty': -2.5 is not in the range -2.0<=x<=2.0."),
    (["--runner", "ray", "--gpus-per-worker", "nan"],
     "Invalid value for '--gpus-per-worker': nan is not a finite number"),
    (["--k", "99999"], "Invalid value for '--num-speculative-tokens' / '--k': 99999 is not in the "
                       "range 1<=x<=32."),
    (["--n", "99999999999999"], "Invalid value for '--n': 99999999999999 is not in the range "
                                "1<=x<=65536."),
    (["--threads", "99999"], "Invalid value for '--threads': 99999 is not in the range "
                             "1<=x<=1024."),
    (["--id-column", ""], "Invalid value for '--id-column': '' is blank: give a name or a path"),
])
def test_values_that_crashed_the_job_are_refused_as_options(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str) -> None:
    """Found by QA: a huge --top-k, --k, --n or --threads gave an overflow, a 256 GB allocation,
    a MemoryError or a segfault; NaN passed --draft-confidence's range, and NaN or inf
    --temperature was refused only later, by the field's name (a NaN --gpus-per-worker gave a
    traceback)."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(EXAMPLES / "prompts.parquet", tmp_path)
    result = CliRunner().invoke(main, ["generate", "prompts.parquet", "out", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert sorted(os.listdir(tmp_path)) == ["prompts.parquet"]


@pytest.mark.parametrize("command, option", [
    (["bench", "--prompts", "examples/prompts.parquet", "--out", "report"], "--draft-confidence"),
    (["train-drafter", "--prompts", "examples/prompts.parquet", "--out", "data"],
     "--answer-temperature"),
    (["train-drafter", "--prompts", "examples/prompts.parquet", "--out", "data"], "--lr"),
    (["train-drafter", "--prompts", "examples/prompts.parquet", "--out", "data"],
     "--token-loss-weight"),
])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_float_option_that_is_not_finite_is_refused_as_such(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], option: str,
        value: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLES / "prompts.parquet", tmp_path / "examples")
    result = CliRunner().invoke(main, [*command, option, value])
    assert result.exit_code == 2
    if value == "inf" and option == "--draft-confidence":  # above the range's 1 anyway
        assert f"Invalid value for '{option}': inf is not in the range 0<=x<1." in result.output
    else:
        assert f"Invalid value for '{option}': {value} is not a finite number" in result.output
    assert sorted(os.listdir(tmp_path)) == ["examples"]  # nothing written
