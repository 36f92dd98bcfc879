"""Detokenize stage with the tiny real tokenizer."""

from __future__ import annotations

from typing import Any

from pipeline.stages.detokenize import cut_at_stop, detokenize
from runtime.request import Completion


def test_decodes_skipping_special_tokens_and_cuts_at_the_stop_string(tiny_tokenizer: Any) -> None:
    ids = tuple(tiny_tokenizer("Paris is the capital of France.")["input_ids"])
    eos = tiny_tokenizer.eos_token_id
    done = [Completion("0:0", (1,), ids + (eos,), "stop"),
            Completion("1:0", (1,), ids, "stop", stop_string="capital"),
            Completion("2:0", (1,), (), "length")]
    assert detokenize(done, tiny_tokenizer) == ["Paris is the capital of France.",
                                                "Paris is the ", ""]


def test_cut_at_first_occurrence() -> None:
    assert cut_at_stop("a.b.c", ".") == "a"
    assert cut_at_stop("abc", None) == "abc"
    assert cut_at_stop("abc", "x") == "abc"
