"""`eaglebatch generate --guided-choice`, and the guided_choice column, through the real CLI: a
classification job on the default model with its drafter, and the options' edges on the tiny
checkpoint."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from click.testing import CliRunner, Result

from jobs.cli import main
from runtime.config import DEFAULT_MODEL, EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from tests.jobs.generate_cases import rows_alike_with_the_drafter
from tests.pipeline.helpers import read_parts, write_parquet

REVIEWS = ["The food was cold and the waiter was rude.", "Wonderful stay, I would come back!",
           "Terrible battery, it died in an hour.", "Great sound and a fair price."]
LABELS = ("The review is positive.", "The review is negative.")


def _generate(model: str, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model", model,
                                     "--kv-cache-memory", "64MiB", "--max-tokens", "12", *args])


def test_a_classification_job_on_the_default_model(tmp_path: Path, smollm2_dir: Path) -> None:
    """One-word labels: each review gets the right one. Sentences as labels: each row is one
    of them, the engine's tokens for those choices, and the shipped drafter, which drafts
    them, gives the same rows. Without guidance the model answers otherwise."""
    path = write_parquet(tmp_path / "in.parquet", {"prompt": [
        f"Is this review positive or negative?\n\n{r}" for r in REVIEWS]})
    asked = write_parquet(tmp_path / "asked.parquet", {"prompt": [
        f"Is this review positive or negative? Answer with one word.\n\n{r}" for r in REVIEWS]})
    words = _generate(DEFAULT_MODEL, asked, tmp_path / "words", "--drafter", "none",
                      "--guided-choice", "positive", "--guided-choice", "negative")
    assert words.exit_code == 0, words.output
    assert [r["completion"] for r in read_parts(tmp_path / "words").to_pylist()] == [
        "negative", "positive", "negative", "positive"]
    choices = ("--guided-choice", LABELS[0], "--guided-choice", LABELS[1])
    got = rows_alike_with_the_drafter(_generate, path, tmp_path, *choices)
    assert {r["completion"] for r in got} <= set(LABELS)
    assert {r["finish_reason"] for r in got} == {"stop"}
    engine = Engine(EngineConfig(model=str(smollm2_dir), kv_cache_memory=64 << 20))
    for prompt, row in zip([r["prompt"] for r in got], got, strict=True):
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                    tokenize=False, add_generation_prompt=True)
        ids = tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
        [done] = engine.generate([GenerationRequest("x", ids, SamplingParams(
            max_tokens=12, guided_choice=LABELS))])
        assert list(done.token_ids) == row["completion_token_ids"]
    plain = _generate(DEFAULT_MODEL, path, tmp_path / "plain", "--drafter", "none")
    assert plain.exit_code == 0
    assert all(r["completion"] not in LABELS + ("positive", "negative")
               for r in read_parts(tmp_path / "plain").to_pylist())


def test_column_edges_and_refusals(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    path = write_parquet(tmp_path / "in.parquet", {
        "prompt": ["Paris is", "The fox", "Numbers", "Paris is", "The fox"],
        "guided_choice": pa.array([None, ["yes", None, "no"], [], ["yes", ""], ["\u00e6"]],
                                  pa.list_(pa.string()))})
    result = _generate(model, path, tmp_path / "out", "--guided-choice", "Rome",
                       "--guided-choice", "Paris")
    assert result.exit_code == 0, result.output
    rows = read_parts(tmp_path / "out").to_pylist()
    assert rows[0]["completion"] in ("Rome", "Paris") and rows[0]["finish_reason"] == "stop"
    assert rows[1]["completion"] in ("yes", "no") and rows[1]["finish_reason"] == "stop"
    assert rows[2]["finish_reason"] in ("stop", "length")  # [] : no guidance for that row
    assert rows[3]["error"] == ("bad per-row sampling option: guided choices must not be empty "
                                "strings")
    assert rows[4]["error"] == "guided choice '\u00e6': no tokens of this vocabulary spell it"
    # the same choices in another order, repeated: the same job; others are refused
    again = _generate(model, path, tmp_path / "out", "--guided-choice", "Paris",
                      "--guided-choice", "Rome", "--guided-choice", "Paris")
    assert again.exit_code == 0, again.output
    other = _generate(model, path, tmp_path / "out", "--guided-choice", "Paris")
    assert other.exit_code != 0 and "holds the outputs of a different job" in other.output
    report = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert report.exit_code == 0, report.output
    assert "guided_choice 'Paris', 'Rome'" in (tmp_path / "out" / "report.md").read_text()
    for args, said in (
            (("--guided-choice", "\u00e6"), "error: --guided-choice: guided choice '\u00e6': no "
                                            "tokens of this vocabulary spell it"),
            (("--guided-choice", "a", "--ignore-eos"), "not with ignore_eos"),
            (("--guided-choice", ""), "guided choices must not be empty strings")):
        bad = _generate(model, path, tmp_path / "bad", *args)
        assert bad.exit_code != 0 and said in bad.output, (args, bad.output)
    typed = write_parquet(tmp_path / "typed.parquet", {"prompt": ["x"], "guided_choice": ["a"]})
    bad = _generate(model, typed, tmp_path / "typed")
    assert bad.exit_code == 2 and ("column 'guided_choice' overrides the guided_choice option "
                                   "per row and must be list<string>") in bad.stderr
