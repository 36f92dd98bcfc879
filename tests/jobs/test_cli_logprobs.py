"""`eaglebatch generate --logprobs`: a completion_logprobs column, through the real CLI and
engine on the tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner, Result

from jobs.cli import main
from tests.drafter_fixtures import make_random_drafter
from tests.pipeline.helpers import read_parts, write_parquet

PROMPTS = ["Paris is the capital of", "The quick brown fox", None, "Numbers: 0 1 2 3"]


def _generate(model_dir: Path, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model",
                                     str(model_dir), "--kv-cache-memory", "16MiB",
                                     "--max-tokens", "10", *args])


def test_logprobs_column_one_per_token_the_same_with_a_drafter(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    drafter = make_random_drafter(tiny_model_dir, tmp_path / "drafter")
    runs = {}
    for name, args in (("plain", ()), ("drafter", ("--drafter", str(drafter), "--k", "3")),
                       ("sampled", ("--temperature", "0.9", "--seed", "1"))):
        result = _generate(tiny_model_dir, path, tmp_path / name, "--logprobs", *args)
        assert result.exit_code == 0, result.output
        runs[name] = read_parts(tmp_path / name)
    table = runs["plain"]
    assert table.schema.names[-2:] == ["error", "completion_logprobs"]
    assert table.schema.field("completion_logprobs").type == pa.list_(pa.float32())
    for run in runs.values():
        for row in run.to_pylist():
            if row["finish_reason"] == "error":
                assert row["completion_logprobs"] is None and row["prompt"] is None
            else:
                assert len(row["completion_logprobs"]) == row["completion_tokens"] > 0
                assert all(lp <= 0 for lp in row["completion_logprobs"])
    # the drafter changes neither tokens nor log-probabilities
    assert runs["drafter"].drop(["num_drafted", "num_accepted"]).equals(
        table.drop(["num_drafted", "num_accepted"]))
    assert sum(runs["drafter"].column("num_drafted").to_pylist()) > 0
    assert runs["sampled"].column("completion_logprobs") != table.column("completion_logprobs")
    # without --logprobs: no such column, the same tokens
    assert _generate(tiny_model_dir, path, tmp_path / "none").exit_code == 0
    without = read_parts(tmp_path / "none")
    assert "completion_logprobs" not in without.schema.names
    assert without.equals(table.drop(["completion_logprobs"]))


def test_logprobs_job_refuses_to_resume_without_it_and_a_clashing_column(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS[:2]})
    assert _generate(tiny_model_dir, path, tmp_path / "out").exit_code == 0
    result = _generate(tiny_model_dir, path, tmp_path / "out", "--logprobs")
    assert result.exit_code == 2
    assert "holds the outputs of a different job (logprobs: not given -> True)" in result.stderr
    clash = tmp_path / "clash.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS[:1], "completion_logprobs": [[0.0]]}), clash)
    result = _generate(tiny_model_dir, clash, tmp_path / "out2", "--logprobs")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {clash}: input column 'completion_logprobs' has the "
                                    "name of an output column")
    # without --logprobs the column is only an input column, passed through
    assert _generate(tiny_model_dir, clash, tmp_path / "out3").exit_code == 0
