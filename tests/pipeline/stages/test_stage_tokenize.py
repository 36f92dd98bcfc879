"""Tokenize stage with the tiny real tokenizer: templates, raw prompts, error rows, clamping."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig
from pipeline.sources import open_inputs
from pipeline.stages.tokenize import PreparedRow, TokenizeOptions, tokenize_rows
from runtime.config import SamplingParams
from tests.pipeline.helpers import write_parquet

DEFAULTS = SamplingParams(max_tokens=16, temperature=0.0, stop=("END",))


def _options(**kw: Any) -> TokenizeOptions:
    base = {"prompt_column": "prompt", "messages_column": None, "use_chat_template": True,
            "max_model_len": 512, "defaults": DEFAULTS}
    return TokenizeOptions(**{**base, **kw})


def test_chat_template_wraps_the_prompt_as_a_user_message(tiny_tokenizer: Any) -> None:
    rows = pa.table({"prompt": ["Paris is"]})
    [row] = tokenize_rows(rows, tiny_tokenizer, _options())
    expected = tiny_tokenizer("<s>user: Paris is</s>\nassistant:",
                              add_special_tokens=False)["input_ids"]
    assert row == PreparedRow(tuple(expected), DEFAULTS, False, None)
    assert expected[0] == tiny_tokenizer.bos_token_id


def test_raw_prompt_without_template(tiny_tokenizer: Any) -> None:
    rows = pa.table({"prompt": ["Paris is"]})
    [row] = tokenize_rows(rows, tiny_tokenizer, _options(use_chat_template=False))
    assert row.prompt_token_ids == tuple(tiny_tokenizer("Paris is")["input_ids"])


def test_messages_column(tiny_tokenizer: Any) -> None:
    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    rows = pa.table({"msgs": messages})
    [row] = tokenize_rows(rows, tiny_tokenizer, _options(messages_column="msgs"))
    text = "<s>system: Be brief.</s>\nuser: Hi</s>\nassistant:"
    expected = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert row.prompt_token_ids == tuple(expected)


def test_bad_rows_become_error_rows(tiny_tokenizer: Any) -> None:
    rows = pa.table({"prompt": ["ok", None, "", "  \n", "fine"]})
    got = tokenize_rows(rows, tiny_tokenizer, _options())
    assert [r.error for r in got] == [None, "prompt is null", "prompt is empty", None, None]
    assert got[1] == PreparedRow(None, None, False, "prompt is null")
    # a prompt of whitespace is text (a raw completion may continue "\n"), not an empty one
    raw = tokenize_rows(rows, tiny_tokenizer, _options(use_chat_template=False))[3]
    assert raw.prompt_token_ids == tuple(tiny_tokenizer("  \n")["input_ids"])


def test_malformed_messages_become_error_rows(tiny_tokenizer: Any) -> None:
    struct = pa.struct([("role", pa.string()), ("content", pa.string())])
    rows = pa.table({"msgs": pa.array([
        None, [], [{"role": None, "content": "x"}], [{"role": "user", "content": None}],
        [{"role": "user", "content": "x"}]], pa.list_(struct))})
    got = tokenize_rows(rows, tiny_tokenizer, _options(messages_column="msgs"))
    assert [r.error for r in got] == ["messages is null", "messages is empty",
                                      "messages[0] has no role",
                                      "messages[0] (user) has null content", None]


def test_failing_chat_template_is_a_row_error(tiny_tokenizer: Any) -> None:
    strict = copy.deepcopy(tiny_tokenizer)
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('the first message must be from the user') }}"
                            "{% endif %}{{ messages[0]['content'] }}")
    rows = pa.table({"msgs": [[{"role": "assistant", "content": "x"}],
                              [{"role": "user", "content": "x"}]]})
    got = tokenize_rows(rows, strict, _options(messages_column="msgs"))
    assert got[0].error == "chat template failed: the first message must be from the user"
    assert got[1].error is None


def test_prompt_too_long_and_max_tokens_clamped(tiny_tokenizer: Any) -> None:
    raw = _options(use_chat_template=False, max_model_len=7)
    texts = ["a b c d e f", "a b c", "a b"]
    assert [len(tiny_tokenizer(t)["input_ids"]) for t in texts] == [7, 3, 2]
    rows = pa.table({"prompt": texts, "max_tokens": [None, None, 5]})
    got = tokenize_rows(rows, tiny_tokenizer, raw)
    assert got[0].error == ("prompt has 7 tokens; the model's context is 7 tokens, "
                            "so a prompt may have at most 6")
    assert got[0].prompt_token_ids is not None and len(got[0].prompt_token_ids) == 7
    assert got[1].max_tokens_clamped and got[1].params is not None
    assert got[1].params.max_tokens == 4  # 7 - 3, not the 16 asked for
    assert not got[2].max_tokens_clamped and got[2].params is not None
    assert got[2].params.max_tokens == 5  # 5 fits (7 - 2)


def test_per_row_overrides_and_nulls_falling_back_to_the_job(tiny_tokenizer: Any) -> None:
    rows = pa.table({
        "prompt": ["a", "b", "c"],
        "max_tokens": pa.array([4, None, 9], pa.int32()),
        "temperature": [0.5, None, 1],
        "top_p": [None, 0.9, None],
        "top_k": pa.array([None, None, 3], pa.int64()),
        "seed": pa.array([11, None, None], pa.int64()),
        "stop": pa.array([["x", ""], None, []], pa.list_(pa.string())),
    })
    got = [r.params for r in tokenize_rows(rows, tiny_tokenizer, _options())]
    assert got == [
        SamplingParams(max_tokens=4, temperature=0.5, seed=11, stop=("x",)),
        SamplingParams(max_tokens=16, top_p=0.9, stop=("END",)),
        SamplingParams(max_tokens=9, temperature=1, top_k=3, stop=()),
    ]


def test_a_stop_column_of_empty_lists_is_accepted(tmp_path: Path, tiny_tokenizer: Any) -> None:
    """pyarrow infers list<null> for [[], []]: accepted (it was refused as not list<string>);
    its rows have no stop strings, as the empty list<string> rows above."""
    path = write_parquet(tmp_path / "in.parquet", {"prompt": ["a", "b"], "stop": [[], [None]]})
    assert pq.read_schema(path).field("stop").type == pa.list_(pa.null())
    _, schema, _ = open_inputs(JobConfig(input=str(path), output_dir=str(tmp_path / "out")))
    rows = pq.read_table(path)
    got = [r.params for r in tokenize_rows(rows, tiny_tokenizer, _options())]
    assert [p.stop for p in got if p is not None] == [(), ()]


@pytest.mark.parametrize(("column", "value", "message"), [
    ("temperature", -1.0, "temperature must be a finite number >= 0, got -1.0"),
    ("temperature", float("nan"), "temperature must be a finite number >= 0, got nan"),
    ("temperature", float("inf"), "temperature must be a finite number >= 0, got inf"),
    ("top_p", float("nan"), "top_p must be in (0, 1], got nan"),
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
])
def test_bad_override_value_is_a_row_error(tiny_tokenizer: Any, column: str, value: object,
                                           message: str) -> None:
    rows = pa.table({"prompt": ["a", "b"], column: [value, None]})
    got = tokenize_rows(rows, tiny_tokenizer, _options())
    assert got[0].error == f"bad per-row sampling option: {message}"
    assert got[0].params is None and got[1].error is None
