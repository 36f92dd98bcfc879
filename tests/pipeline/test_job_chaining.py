"""A job that reads another job's outputs (answers to generated questions, judgments of
answers): --output-prefix names its own columns apart from the ones it reads."""

from __future__ import annotations

import shutil
from pathlib import Path

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
                              {"prompt": ["Ask about rain", None, "Ask about bread", ""]})
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
        f"(output columns: {', '.join(OUTPUTS)})\n")  # sample_index only with --n > 1
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
    assert [r["id"] for r in rows] == ["topics:0", "topics:1", "topics:2", "topics:3"]
    for row in rows[::2]:  # each question is answered as a prompt of its own
        assert row["answer_completion_token_ids"] == _greedy(tiny_engine, row["completion"])
        assert row["answer_finish_reason"] in ("stop", "length")
    assert [(r["error"], r["answer_error"]) for r in rows[1::2]] == [
        ("prompt is null", "prompt is null"), ("prompt is empty", "prompt is null")]
    # a rerun with another prefix would write other columns: refused, named
    code, stderr = _generate(str(first), str(second), *model, "--prompt-column", "completion",
                             "--output-prefix", "reply_")
    assert code == 2 and "columns.output_prefix: 'answer_' -> 'reply_'" in stderr
    # the job's report finds its error rows under its own column
    result = CliRunner().invoke(main, ["report", str(second)])
    assert result.exit_code == 0, result.output
    report = (second / "report.md").read_text()
    assert ("\n- prompts from `completion`, ids from `id`; the job's columns `answer_completion`, "
            "... (`--output-prefix answer_`)\n") in report
    errors = ("## Error rows by message\n\n| error rows | error |\n| ---: | --- |\n"
              "| 2 | `prompt is null` |\n")  # its own, not the first job's (null, empty)
    assert errors in report
    # the same without the manifest (it read the first job's error column)
    (second / "manifest.json").unlink()
    result = CliRunner().invoke(main, ["report", str(second)])
    assert result.exit_code == 0, result.output
    assert errors in (second / "report.md").read_text()


def test_reading_other_jobs_outputs_is_refused_where_rows_would_be_lost_or_misnamed(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    model = ("--model", str(tiny_model_dir))
    topics = write_parquet(tmp_path / "topics.parquet",
                           {"prompt": ["Ask about rain", "Ask about snow"], "max_tokens": [2, 3]})
    first = tmp_path / "questions"
    code, stderr = _generate(str(topics), str(first), *model, "--shard-rows", "1")
    assert code == 0, stderr
    # the first job's per-row options would apply again: said
    answer = ("--prompt-column", "completion", "--output-prefix", "answer_")
    code, stderr = _generate(str(first), str(tmp_path / "answers"), *model, *answer)
    assert code == 0, stderr
    assert ("note: input column(s) max_tokens override the job's options row by row where they "
            "are not null (rename them to apply the options to every row)\n") in stderr
    assert read_parts(tmp_path / "answers").column("answer_completion_tokens").to_pylist() == [
        2, 3]
    # a finished job's folder whose manifest was deleted is still known by its files: its
    # stats.parquet is not read as rows (it failed on that file's schema)
    bare = tmp_path / "bare"
    shutil.copytree(first, bare)
    (bare / "manifest.json").unlink()
    code, stderr = _generate(str(bare), str(tmp_path / "from_bare"), *model, *answer)
    assert code == 0, stderr
    assert read_parts(tmp_path / "from_bare") == read_parts(tmp_path / "answers")
    code, stderr = _generate(f"{bare}/*.parquet", str(tmp_path / "bare_glob"), *model, *answer)
    assert code == 0 and f"such as {bare / 'stats.parquet'}" in stderr
    # a glob of every file in a job's folder reads its part files alone (it failed on
    # manifest.json: "not a readable Parquet file")
    code, stderr = _generate(f"{first}/*", str(tmp_path / "star"), *model, *answer)
    assert code == 0, stderr
    assert "left out 3 file(s) the glob's wildcards matched that are not data" in stderr
    assert read_parts(tmp_path / "star") == read_parts(tmp_path / "answers")
    # a job that has not finished: its unfinished shards' rows would be missing
    (first / "_SUCCESS").unlink()
    code, stderr = _generate(str(first), str(tmp_path / "early"), *model, *answer)
    assert (code, stderr) == (2, (
        f"error: input directory {first} is the OUTPUT_DIR of a job that has not finished (no "
        f"_SUCCESS): rows of its unfinished shards would be missing; finish that job (rerun its "
        f"command), or give the part files written so far as a glob, "
        f"'{first / 'part-*.parquet'}'\n"))
    # a glob over the folder leaves out the job's stats.parquet (its schema is another)
    code, stderr = _generate(f"{first}/*.parquet", str(tmp_path / "globbed"), *model, *answer)
    assert code == 0, stderr
    assert f"left out 1 file(s) the glob's wildcards matched that are not data, such as " \
           f"{first / 'stats.parquet'}" in stderr
    # the prefix that made the columns read, again: the way out is another prefix
    again = tmp_path / "answers"
    code, stderr = _generate(str(again), str(tmp_path / "x"), *model, "--prompt-column",
                             "answer_completion", "--output-prefix", "answer_")
    assert code == 2 and ("input column 'answer_completion' has the name of an output column; "
                          "choose another --output-prefix ('answer_' makes 'answer_completion' "
                          "too)") in stderr
    for bad in (" ", "a b_", "\t", "\udcff_"):
        code, stderr = _generate(str(again), str(tmp_path / "x"), *model, "--output-prefix", bad)
        assert (code, stderr) == (2, f"error: --output-prefix {bad!r}: column names made with it "
                                     "would hold spaces, control characters or bytes that are "
                                     "not UTF-8; choose letters, digits and signs such as _\n")


def test_a_job_with_samples_as_input_says_how_to_name_its_rows(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Samples of a row share its id: the refusal of repeated ids said nothing more."""
    model = ("--model", str(tiny_model_dir))
    topics = write_parquet(tmp_path / "topics.parquet", {"prompt": ["Ask about rain"]})
    first = tmp_path / "questions"
    code, stderr = _generate(str(topics), str(first), *model, "--n", "2", "--seed", "1",
                             "--temperature", "0.8")
    assert code == 0, stderr
    answer = ("--prompt-column", "completion", "--output-prefix", "answer_")
    code, stderr = _generate(str(first), str(tmp_path / "answers"), *model, *answer)
    part = first / "part-00000.parquet"
    assert (code, stderr) == (2, (
        f"error: duplicate id 'topics:0' in column 'id': {part} row 0 and {part} row 1; ids "
        "must be unique (the input is the output of a job with --n > 1, whose samples of a row "
        "share its id: name a new id column, e.g. --id-column id_2, and ids are made from file "
        "and row)\n"))
    code, stderr = _generate(str(first), str(tmp_path / "answers"), *model, *answer,
                             "--id-column", "id_2")
    assert code == 0, stderr
    rows = read_parts(tmp_path / "answers").to_pylist()
    assert [(r["id_2"], r["id"], r["sample_index"]) for r in rows] == [
        ("part-00000:0", "topics:0", 0), ("part-00000:1", "topics:0", 1)]
    # a second --n job over those: the name suggested is one the input does not have yet
    code, stderr = _generate(str(tmp_path / "answers"), str(tmp_path / "judged"), *model,
                             "--prompt-column", "answer_completion", "--output-prefix", "judge_",
                             "--n", "2", "--seed", "1", "--temperature", "0.8", "--id-column",
                             "id_2")
    assert code == 0, stderr
    code, stderr = _generate(str(tmp_path / "judged"), str(tmp_path / "again"), *model,
                             "--prompt-column", "judge_completion", "--output-prefix", "x_")
    assert code == 2 and "e.g. --id-column id_3, and ids" in stderr  # (id_2 is there)
