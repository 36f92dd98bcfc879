"""`eaglebatch generate --guided-regex`, and the guided_regex column, through the real CLI: JSON
of a fixed shape from the default model with its drafter, and the edges on the tiny
checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner, Result

from jobs.cli import main
from tests.jobs.generate_cases import rows_alike_with_the_drafter
from tests.pipeline.helpers import read_parts, write_parquet

CITY_JSON = r'\{"city": "[A-Z][a-z]+( [A-Z][a-z]+)?", "country": "[A-Z][a-z]+"\}'


def _generate(model: str, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model", model,
                                     "--kv-cache-memory", "64MiB", "--max-tokens", "24", *args])


def test_json_of_a_fixed_shape_from_the_default_model(tmp_path: Path) -> None:
    """Every row is a JSON object of that shape, which the drafter drafts: the same rows with
    and without it."""
    path = write_parquet(tmp_path / "in.parquet", {"prompt": [
        f"What is the capital of {c}? Answer in JSON with the keys city and country."
        for c in ("France", "Japan", "Italy", "Canada")]})
    rows = rows_alike_with_the_drafter(_generate, path, tmp_path, "--guided-regex", CITY_JSON)
    for row in rows:
        assert row["finish_reason"] == "stop" and re.fullmatch(CITY_JSON, row["completion"])
        assert set(json.loads(row["completion"])) == {"city", "country"}
    assert json.loads(rows[0]["completion"]) == {"city": "Paris", "country": "France"}


def test_column_edges_and_refusals(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    path = write_parquet(tmp_path / "in.parquet", {
        "prompt": ["Paris is", "The fox", "Numbers", "Paris is"],
        "guided_regex": [None, "[0-9]{3}", "", "(a"],
        "guided_choice": [None, None, None, None]})
    result = _generate(model, path, tmp_path / "out", "--guided-regex", "[a-e]{2,5}")
    assert result.exit_code == 0, result.output
    rows = read_parts(tmp_path / "out").to_pylist()
    assert rows[0]["finish_reason"] == "stop" and re.fullmatch("[a-e]{2,5}", rows[0]["completion"])
    assert rows[1]["finish_reason"] == "stop" and re.fullmatch("[0-9]{3}", rows[1]["completion"])
    assert not re.fullmatch("[a-e]{2,5}", rows[2]["completion"] or "")  # "": unguided
    assert rows[3]["error"] == "bad per-row sampling option: regex '(a' at position 0: missing ')'"
    # a row's choices replace the job's pattern
    choices = write_parquet(tmp_path / "choices.parquet", {"prompt": ["Paris is"],
                                                           "guided_choice": [["yes", "no"]]})
    result = _generate(model, choices, tmp_path / "choices", "--guided-regex", "[a-e]{2,5}")
    assert result.exit_code == 0, result.output
    assert read_parts(tmp_path / "choices").column("completion").to_pylist()[0] in ("yes", "no")
    other = _generate(model, path, tmp_path / "out", "--guided-regex", "[a-e]{2,6}")
    assert other.exit_code != 0 and "holds the outputs of a different job" in other.output
    report = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert report.exit_code == 0, report.output
    assert "guided_regex '[a-e]{2,5}'" in (tmp_path / "out" / "report.md").read_text()
    for args, said in (
            (("--guided-regex", "(?=x)"), "bad sampling option: regex '(?=x)' at position 0: "
                                          "only (?: ) and (?P<name> ) groups"),
            (("--guided-regex", "\u00e6+"), "error: --guided-regex: guided regex '\u00e6+': no "
                                           "token of this vocabulary starts it"),
            (("--guided-regex", "a", "--guided-choice", "a"), "give one of them"),
            (("--guided-regex", ""), "a guided regex must not be empty")):
        bad = _generate(model, path, tmp_path / "bad", *args)
        assert bad.exit_code != 0 and said in bad.output, (args, bad.output)
