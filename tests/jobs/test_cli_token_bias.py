"""`eaglebatch generate --allowed-token-ids / --logit-bias`, and the allowed_token_ids and
logit_bias columns, through the real CLI and engine on the tiny checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner, Result

from jobs.cli import main
from runtime.config import EngineConfig, SamplingParams
from runtime.engine import Engine
from runtime.request import GenerationRequest
from tests.pipeline.helpers import read_parts, write_parquet

PROMPTS = ["Paris is the capital of", "The quick brown fox", "Numbers: 0 1 2 3"]
ALLOWED = tuple(range(1, 256, 4))


def _generate(model_dir: Path, input_path: Path, out: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["generate", str(input_path), str(out), "--model",
                                     str(model_dir), "--kv-cache-memory", "16MiB",
                                     "--max-tokens", "10", "--ignore-eos", "--no-chat-template",
                                     *args])


def _tokens(out: Path) -> list[list[int] | None]:
    return [r["completion_token_ids"] for r in read_parts(out).to_pylist()]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=16 << 20))


def _engine_tokens(engine: Engine, prompt: str, **params: Any) -> list[int]:
    """The engine's tokens for the prompt as the job tokenizes it without the chat template."""
    ids = tuple(engine.tokenizer(prompt)["input_ids"])
    [done] = engine.generate([GenerationRequest("x", ids, SamplingParams(
        max_tokens=10, ignore_eos=True, **params))])
    return list(done.token_ids)


def test_options_and_columns_give_the_engines_tokens(tmp_path: Path, tiny_model_dir: Path,
                                                     engine: Engine) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS})
    assert _generate(tiny_model_dir, path, tmp_path / "plain").exit_code == 0
    plain = _tokens(tmp_path / "plain")
    assert plain == [_engine_tokens(engine, p) for p in PROMPTS]
    banned = plain[0][0]
    bias = ((banned, -100.0), (ALLOWED[3], 1.5))
    result = _generate(tiny_model_dir, path, tmp_path / "both", "--allowed-token-ids",
                       ",".join(map(str, ALLOWED)), "--logit-bias",
                       f"{ALLOWED[3]}:1.5,{banned}:-100")
    assert result.exit_code == 0, result.output
    both = _tokens(tmp_path / "both")
    assert both == [_engine_tokens(engine, p, allowed_token_ids=ALLOWED, logit_bias=bias)
                    for p in PROMPTS]
    assert all(set(t) <= set(ALLOWED) for t in both if t) and both != plain

    # columns: null keeps the option, empty means none for the row, a value replaces it
    per_row = write_parquet(tmp_path / "per-row.parquet", {
        "prompt": PROMPTS + PROMPTS[:1] * 4,
        "allowed_token_ids": pa.array([None, [], [2, 3, None, 2], None, None, [-1], [256]],
                                      pa.list_(pa.int32())),
        "logit_bias": pa.array([None, None, None, [(banned, -100.0)], [], None, None],
                               pa.map_(pa.int64(), pa.float64()))})
    result = _generate(tiny_model_dir, per_row, tmp_path / "per-row", "--allowed-token-ids",
                       ",".join(map(str, ALLOWED)))
    assert result.exit_code == 0, result.output
    rows = read_parts(tmp_path / "per-row").to_pylist()
    assert [r["completion_token_ids"] for r in rows[:5]] == [
        _engine_tokens(engine, PROMPTS[0], allowed_token_ids=ALLOWED), plain[1],
        _engine_tokens(engine, PROMPTS[2], allowed_token_ids=(2, 3)),
        _engine_tokens(engine, PROMPTS[0], allowed_token_ids=ALLOWED,
                       logit_bias=((banned, -100.0),)),
        _engine_tokens(engine, PROMPTS[0], allowed_token_ids=ALLOWED)]
    assert set(rows[2]["completion_token_ids"]) <= {2, 3}
    assert rows[5]["error"] == ("bad per-row sampling option: allowed token ids must be >= 0, "
                                "got -1")
    assert rows[6]["error"] == ("allowed token id 256 is outside the model's vocabulary (ids 0 "
                                "to 255)")
    report = CliRunner().invoke(main, ["report", str(tmp_path / "per-row")])
    assert report.exit_code == 0, report.output
    assert ("- per-row options from the input's columns `allowed_token_ids`, `logit_bias` (each "
            "row's value, where not null, overrides the job's option)"
            ) in (tmp_path / "per-row" / "report.md").read_text()


def test_bad_options_and_columns_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS[:1]})
    for args, said in (
            (("--logit-bias", "5:1,300:2"), "error: --logit-bias: 300 is outside the vocabulary"),
            (("--allowed-token-ids", "5,256"),
             "error: --allowed-token-ids: 256 is outside the vocabulary"),
            (("--logit-bias", "5:101"),
             "bad sampling option: logit_bias of token 5 must be in [-100, 100], got 101.0"),
            (("--logit-bias", "5:1,5:2"), "token 5 is given more than one bias"),
            (("--logit-bias", "x:1"), "'x' is not a token id (digits 0-9)"),
            (("--logit-bias", '{"5": "a"}'), "the bias of token 5 ('a') is not a number"),
            (("--allowed-token-ids", "5,-1"), "(digits 0-9): '-1'")):
        result = _generate(tiny_model_dir, path, tmp_path / "bad", *args)
        assert result.exit_code != 0 and said in result.output, (args, result.output)
    typed = write_parquet(tmp_path / "typed.parquet", {"prompt": PROMPTS[:1],
                                                       "logit_bias": [[5, 2]]})
    result = _generate(tiny_model_dir, typed, tmp_path / "typed")
    assert result.exit_code == 2
    assert ("column 'logit_bias' overrides the logit_bias option per row and must be "
            "map<integer, number> (token id -> bias), but it is list<element: int64>"
            ) in result.stderr


def test_recorded_for_resume_and_named_in_the_report(tmp_path: Path,
                                                     tiny_model_dir: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"prompt": PROMPTS[:2]})
    out = tmp_path / "out"
    args = ("--allowed-token-ids", "9,5,7", "--logit-bias", '{"7": 2.5, "5": -1}')
    assert _generate(tiny_model_dir, path, out, *args).exit_code == 0
    # the same settings spelled otherwise: the same job (nothing left to do)
    again = _generate(tiny_model_dir, path, out, "--allowed-token-ids", "5,7,9,7",
                      "--logit-bias", "5:-1.0, 7:2.5")
    assert again.exit_code == 0, again.output
    for changed in (("--allowed-token-ids", "5,7"), ("--logit-bias", "5:-1,7:2")):
        result = _generate(tiny_model_dir, path, out, *changed)
        assert result.exit_code != 0 and "holds the outputs of a different job" in result.output
    report = CliRunner().invoke(main, ["report", str(out)])
    assert report.exit_code == 0, report.output
    text = (out / "report.md").read_text()
    assert "allowed_token_ids [5, 7, 9]" in text and "logit_bias 5:-1,7:2.5" in text
