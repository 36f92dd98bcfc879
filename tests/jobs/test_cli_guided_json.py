"""`eaglebatch generate --guided-json`, and the guided_json column, through the real CLI: records
of a schema from the default model with its drafter, and the edges on the tiny checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner, Result

from jobs.cli import main
from runtime.json_schema import schema_regex
from tests.jobs.generate_cases import rows_alike_with_the_drafter
from tests.pipeline.helpers import read_parts, write_parquet

BOOK = {"type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "year": {"type": "integer"},
                       "genre": {"enum": ["novel", "poetry", "drama"]}},
        "required": ["title", "year", "genre"]}


def _generate(model: str, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model", model,
                                     "--kv-cache-memory", "64MiB", "--max-tokens", "40", *args])


def test_records_of_a_schema_from_the_default_model(tmp_path: Path) -> None:
    """Every row is a record the schema allows (checked by hand), from a schema file; the
    shipped drafter gives the same rows."""
    path = write_parquet(tmp_path / "in.parquet", {"prompt": [
        f"Describe the book {b} as JSON." for b in ("Hamlet", "Emma", "Dracula")]})
    schema_file = tmp_path / "book.json"
    schema_file.write_text(json.dumps(BOOK, indent=2))
    for row in rows_alike_with_the_drafter(_generate, path, tmp_path, "--guided-json",
                                           str(schema_file)):
        assert row["finish_reason"] == "stop", row["completion"]
        record = json.loads(row["completion"])
        assert list(record) == ["title", "year", "genre"]
        assert isinstance(record["title"], str) and len(record["title"]) <= 40
        assert isinstance(record["year"], int) and record["genre"] in ("novel", "poetry", "drama")


def test_column_edges_and_refusals(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    digits = json.dumps({"type": "array", "items": {"enum": [1, 2]}, "minItems": 1,
                         "maxItems": 3})
    path = write_parquet(tmp_path / "in.parquet", {
        "prompt": ["Paris is", "The fox", "Numbers"],
        "guided_json": [None, json.dumps({"type": "boolean"}), "{\"type\": \"integer\", "
                                                               "\"maximum\": 3}"]})
    result = _generate(model, path, tmp_path / "out", "--guided-json", digits)
    assert result.exit_code == 0, result.output
    rows = read_parts(tmp_path / "out").to_pylist()
    assert rows[0]["finish_reason"] == "stop"
    assert re.fullmatch(schema_regex(digits), rows[0]["completion"])
    assert json.loads(rows[0]["completion"])[0] in (1, 2)
    assert rows[1]["completion"] in ("true", "false")
    assert rows[2]["error"] == ("bad per-row sampling option: guided JSON schema at #: "
                                "'maximum' is not supported (the completion would not be held "
                                "to it)")
    # the same schema spaced otherwise: the same job
    spaced = json.dumps(json.loads(digits), indent=4)
    assert _generate(model, path, tmp_path / "out", "--guided-json", spaced).exit_code == 0
    other = _generate(model, path, tmp_path / "out", "--guided-json", '{"type": "boolean"}')
    assert other.exit_code != 0 and "holds the outputs of a different job" in other.output
    report = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert report.exit_code == 0, report.output
    assert 'guided_json {"type":"array"' in (tmp_path / "out" / "report.md").read_text()
    for args, said in (
            (("--guided-json", "{'a': 1}"), "not a JSON schema"),
            (("--guided-json", "nosuchfile.json"),
             "'nosuchfile.json' is neither a JSON schema's text (an object, '{...}') nor a file"),
            (("--guided-json", '{"type": "string", "pattern": "(?=x)"}'),
             "guided JSON schema at #/pattern: regex '(?=x)' at position 0"),
            (("--guided-json", '{"type": "string", "maxLength": 2000}'),
             "at #: minLength / maxLength of at most 1000"),
            (("--guided-json", '{"type": "object"}'), "an object needs properties"),
            (("--guided-json", digits, "--guided-regex", "a"),
             "guided_regex and guided_json: give one of them")):
        bad = _generate(model, path, tmp_path / "bad", *args)
        assert bad.exit_code != 0 and said in bad.output, (args, bad.output)
