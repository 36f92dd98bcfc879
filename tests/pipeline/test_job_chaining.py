"""A job that reads another job's outputs (answers to generated questions, judgments of
answers): --output-prefix names its own columns apart from the ones it reads."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
from click.testing import CliRunner

from jobs.cli import main
from runtime.config import SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from tests.pipeline.helpers import read_parts, write_parquet

OUTPUTS = ["completion", "completion_token_ids", "finish_reason", "prompt_tokens",
           "completion_tokens", "num_drafted", "num_accepted", "max_tokens_clamped", "error"]


def _generate(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["generate", *args, "--max-tokens", "4",
                                       "--kv-cache-memory", "16MiB"])
    return result.exit_code, result.stderr


def _greedy(engine: Engine, prompt: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                tokenize=False, add_generation_prompt=True)
    ids = tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    [done] = engine.generate([GenerationRequest("x", ids, SamplingParams(max_tokens=4))])
    return list(done.token_ids)


def test_a_job_reads_another_jobs_outputs_with_an_output_prefix(
        tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> None:
    model = ("--model", str(tiny_model_dir))
    questions = write_parquet(tmp_path / "topics.parquet",
                              {"prompt": ["Ask about rain", None, "Ask about bread"]})
    first, second = tmp_path / "questions", tmp_path / "answers"
    code, stderr = _generate(str(questions), str(first), *model)
    assert code == 0, stderr
    asked = read_parts(first)
    assert asked.column("finish_reason").to_pylist()[1] == "error"  # the null prompt
    # without a prefix the job's columns would replace the ones it reads: refused, with the way
    code, stderr = _generate(str(first), str(second), *model, "--prompt-column", "completion")
    assert code == 2
    assert stderr == (
        f"error: {first / 'part-00000.parquet'}: input column 'completion' has the name of an "
        "output column; rename it, or give the output columns a prefix with --output-prefix "
        f"(output columns: {', '.join(OUTPUTS)}, sample_index)\n")
    assert not second.exists()
    answer = ("--prompt-column", "completion", "--output-prefix", "answer_")
    code, stderr = _generate(str(first), str(second), *model, *answer)
    assert code == 0, stderr
    answered = read_parts(second)
    # every column of the first job's outputs passes through, the second job's follow
    assert answered.column_names == asked.column_names + [f"answer_{n}" for n in OUTPUTS]
    assert answered.select(asked.column_names) == asked.cast(answered.select(
        asked.column_names).schema)
    rows = answered.to_pylist()
    assert [r["id"] for r in rows] == ["topics:0", "topics:1", "topics:2"]
    for row in rows[::2]:  # each question is answered as a prompt of its own
        assert row["answer_completion_token_ids"] == _greedy(tiny_engine, row["completion"])
        assert row["answer_finish_reason"] in ("stop", "length")
    assert (rows[1]["answer_finish_reason"], rows[1]["answer_error"]) == ("error",
                                                                          "prompt is null")
    # a rerun with another prefix would write other columns: refused, named
    code, stderr = _generate(str(first), str(second), *model, "--prompt-column", "completion",
                             "--output-prefix", "reply_")
    assert code == 2 and "columns.output_prefix: 'answer_' -> 'reply_'" in stderr
    # the job's report finds its error rows under its own column
    result = CliRunner().invoke(main, ["report", str(second)])
    assert result.exit_code == 0, result.output
    report = (second / "report.md").read_text()
    assert "## Error rows by message\n\n| error rows | error |\n| ---: | --- |\n| 1 | " \
           "`prompt is null` |" in report
    assert pq.read_schema(second / "part-00000.parquet").names[-1] == "answer_error"
