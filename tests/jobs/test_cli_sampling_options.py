"""`eaglebatch generate --min-p / --repetition-penalty / --frequency-penalty / --presence-penalty`
and the per-row columns of the same names, through the real CLI and engine on the tiny
checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
from click.testing import CliRunner, Result

from jobs.cli import main
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from tests.pipeline.helpers import read_parts, write_parquet

PROMPTS = ["Paris is the capital of", "The quick brown fox", "Numbers: 0 1 2 3", "Berlin is"]
MAX_TOKENS = 12


def _generate(model_dir: Path, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model",
                                     str(model_dir), "--kv-cache-memory", "16MiB",
                                     "--max-tokens", str(MAX_TOKENS), *args])


def _engine_tokens(model_dir: Path, prompt_ids: list[list[int]],
                   params: list[SamplingParams]) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(model_dir), kv_cache_memory=16 << 20))
    requests = [GenerationRequest(str(i), tuple(ids), p)
                for i, (ids, p) in enumerate(zip(prompt_ids, params, strict=True))]
    done = {c.request_id: list(c.token_ids) for c in engine.generate(requests)}
    return [done[str(i)] for i in range(len(requests))]


def test_penalty_options_and_columns_reach_the_engine(tmp_path: Path,
                                                      tiny_model_dir: Path) -> None:
    """The options apply to every row; a column overrides them where not null. Each row's tokens
    are the engine's for those parameters, and the penalties change them."""
    path = write_parquet(tmp_path / "in.parquet", {
        "prompt": PROMPTS,
        "repetition_penalty": pa.array([None, 1.0, 2, None], pa.float64()),
        "presence_penalty": pa.array([None, None, None, -1.5], pa.float32())})
    args = ("--repetition-penalty", "1.5", "--frequency-penalty", "0.75")
    result = _generate(tiny_model_dir, path, tmp_path / "out", *args)
    assert result.exit_code == 0, result.output
    assert ("note: input column(s) repetition_penalty, presence_penalty override the job's "
            "options row by row") in result.stderr
    rows = read_parts(tmp_path / "out").to_pylist()
    base = dict(max_tokens=MAX_TOKENS, frequency_penalty=0.75)
    params = [SamplingParams(**base, repetition_penalty=1.5),
              SamplingParams(**base),
              SamplingParams(**base, repetition_penalty=2.0),
              SamplingParams(**base, repetition_penalty=1.5, presence_penalty=-1.5)]
    prompt_ids = [_prompt_ids(tiny_model_dir, p) for p in PROMPTS]
    got = [r["completion_token_ids"] for r in rows]
    assert got == _engine_tokens(tiny_model_dir, prompt_ids, params)
    plain = _engine_tokens(tiny_model_dir, prompt_ids,
                           [SamplingParams(max_tokens=MAX_TOKENS)] * len(PROMPTS))
    assert sum(g != p for g, p in zip(got, plain, strict=True)) >= 3


def _prompt_ids(model_dir: Path, prompt: str) -> list[int]:
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_bad_penalty_in_a_row_fails_that_row_only(tmp_path: Path,
                                                    tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {
        "prompt": PROMPTS[:3], "frequency_penalty": [0.5, 2.5, None],
        "repetition_penalty": [1.1, 1.1, float("nan")]})
    result = _generate(tiny_model_dir, path, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "done: 3 rows (2 errors), " in result.stdout
    rows = read_parts(tmp_path / "out").to_pylist()
    assert [r["finish_reason"] for r in rows][0] in ("stop", "length")
    assert [r["error"] for r in rows] == [
        None,
        "bad per-row sampling option: frequency_penalty must be in [-2, 2] (0 = off), got 2.5",
        "bad per-row sampling option: repetition_penalty must be in [0.01, 100] (1 = off), "
        "got nan"]


def test_a_penalty_column_of_text_is_refused_naming_file_and_column(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS[:1],
                                                   "presence_penalty": ["high"]})
    result = _generate(tiny_model_dir, path, tmp_path / "out")
    assert result.exit_code == 2
    assert result.stderr == (f"error: {path}: column 'presence_penalty' overrides the "
                             "presence_penalty option per row and must be a number, but it is "
                             "string\n")


def test_resuming_with_another_penalty_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS[:2]})
    assert _generate(tiny_model_dir, path, tmp_path / "out").exit_code == 0
    result = _generate(tiny_model_dir, path, tmp_path / "out", "--presence-penalty", "0.5")
    assert result.exit_code == 2
    assert ("holds the outputs of a different job (sampling.presence_penalty: not given -> 0.5)"
            in result.stderr)


def test_min_p_one_gives_the_greedy_tokens(tmp_path: Path, tiny_model_dir: Path) -> None:
    """min_p 1 keeps only the most likely token; a min_p column of null keeps the option."""
    path = write_parquet(tmp_path / "in.parquet", {
        "prompt": PROMPTS, "min_p": pa.array([None, 1.0, 0.0, None], pa.float64())})
    greedy = _generate(tiny_model_dir, path, tmp_path / "greedy")
    assert greedy.exit_code == 0, greedy.output
    result = _generate(tiny_model_dir, path, tmp_path / "out", "--temperature", "2",
                       "--min-p", "1", "--seed", "4")
    assert result.exit_code == 0, result.output
    want = read_parts(tmp_path / "greedy").column("completion_token_ids").to_pylist()
    got = read_parts(tmp_path / "out").column("completion_token_ids").to_pylist()
    assert [g == w for g, w in zip(got, want, strict=True)] == [True, True, False, True]


def test_min_tokens_holds_eos_back_per_option_and_column(tmp_path: Path,
                                                         tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {
        "prompt": [PROMPTS[0]] * 3, "min_tokens": pa.array([None, 0, 9], pa.int64())})
    assert _generate(tiny_model_dir, path, tmp_path / "plain", "--no-chat-template").exit_code == 0
    second = read_parts(tmp_path / "plain").column("completion_token_ids").to_pylist()[0][1]
    model = tmp_path / "early-eos"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": second}))
    result = _generate(model, path, tmp_path / "out", "--no-chat-template", "--min-tokens", "6")
    assert result.exit_code == 0, result.output
    rows = read_parts(tmp_path / "out").to_pylist()
    # --min-tokens 6 (null column), the column's 0 (ends at the EOS, its 2nd token), its 9
    assert [r["completion_tokens"] >= n for r, n in zip(rows, (6, 2, 9), strict=True)] == [
        True, True, True]
    assert rows[1]["completion_tokens"] == 2 and rows[1]["finish_reason"] == "stop"
    assert second not in rows[0]["completion_token_ids"][:6]
