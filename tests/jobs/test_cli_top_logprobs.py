"""`eaglebatch generate --top-logprobs N`: a completion_top_logprobs column, through the real CLI
and engine on the tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner, Result

from jobs.cli import main
from pipeline.schema import TOP_LOGPROBS_FIELD
from tests.drafter_fixtures import make_random_drafter
from tests.pipeline.helpers import read_parts, write_parquet

PROMPTS = ["Paris is the capital of", "The quick brown fox", None, "Numbers: 0 1 2 3"]


def _generate(model_dir: Path, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model",
                                     str(model_dir), "--kv-cache-memory", "16MiB",
                                     "--max-tokens", "10", *args])


def test_top_logprobs_column_n_per_token_the_same_with_a_drafter(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """N structs per token, most likely first; with --logprobs too a greedy token is the first
    of its list with its own log-probability; the drafter changes none of it; without the
    option there is no column and the same tokens."""
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "drafter")
    runs = {}
    for name, args in (("plain", ()), ("drafter", ("--drafter", str(drafter), "--k", "3")),
                       ("prefixed", ("--output-prefix", "m_"))):
        result = _generate(tiny_model_dir, path, tmp_path / name, "--top-logprobs", "4",
                           "--logprobs", *args)
        assert result.exit_code == 0, result.output
        runs[name] = read_parts(tmp_path / name)
    table = runs["plain"]
    assert table.schema.names[-3:] == ["error", "completion_logprobs", "completion_top_logprobs"]
    assert table.schema.field("completion_top_logprobs").type == TOP_LOGPROBS_FIELD.type
    assert runs["prefixed"].schema.names[-2:] == ["m_completion_logprobs",
                                                  "m_completion_top_logprobs"]
    for row in table.to_pylist():
        if row["finish_reason"] == "error":
            assert row["completion_top_logprobs"] is None and row["prompt"] is None
            continue
        top = row["completion_top_logprobs"]
        assert len(top) == row["completion_tokens"] > 0
        for token, logprob, entries in zip(row["completion_token_ids"],
                                           row["completion_logprobs"], top, strict=True):
            assert len(entries) == 4
            assert entries[0] == {"token_id": token, "logprob": logprob}  # greedy: the argmax
            values = [e["logprob"] for e in entries]
            assert values == sorted(values, reverse=True) and values[-1] < values[0] <= 0
    assert runs["drafter"].drop(["num_drafted", "num_accepted"]).equals(
        table.drop(["num_drafted", "num_accepted"]))
    assert sum(runs["drafter"].column("num_drafted").to_pylist()) > 0
    # alone, without --logprobs: only this column; without it, the same tokens and no column
    assert _generate(tiny_model_dir, path, tmp_path / "alone", "--top-logprobs", "4").exit_code == 0
    alone = read_parts(tmp_path / "alone")
    assert alone.equals(table.drop(["completion_logprobs"]))
    assert _generate(tiny_model_dir, path, tmp_path / "none").exit_code == 0
    assert read_parts(tmp_path / "none").equals(alone.drop(["completion_top_logprobs"]))


def test_top_logprobs_bad_values_resume_and_a_clashing_column(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS[:2]})
    for bad in ("21", "-1"):
        result = _generate(tiny_model_dir, path, tmp_path / "bad", "--top-logprobs", bad)
        assert result.exit_code == 2
        assert "Invalid value for '--top-logprobs'" in result.output
        assert f"{bad} is not in the range 0<=x<=20" in result.output
    assert not (tmp_path / "bad").exists()
    assert _generate(tiny_model_dir, path, tmp_path / "out", "--top-logprobs", "2").exit_code == 0
    for other, said in ((("--top-logprobs", "3"), "top_logprobs: 2 -> 3"),
                        ((), "top_logprobs: 2 -> not given")):
        result = _generate(tiny_model_dir, path, tmp_path / "out", *other)
        assert result.exit_code == 2
        assert f"holds the outputs of a different job ({said})" in result.stderr
    clash = tmp_path / "clash.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS[:1], "completion_top_logprobs": [1]}), clash)
    result = _generate(tiny_model_dir, clash, tmp_path / "out2", "--top-logprobs", "1")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {clash}: input column 'completion_top_logprobs' has "
                                    "the name of an output column")
    assert _generate(tiny_model_dir, clash, tmp_path / "out3").exit_code == 0
