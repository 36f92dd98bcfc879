"""Detokenize stage with the tiny real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

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


def test_a_completion_that_ends_inside_a_character_drops_its_partial_bytes(
        smollm2_dir: Path) -> None:
    """Byte-level BPE spreads a character over tokens; max_tokens can stop between them."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tuple(tokenizer("Café — 日本語 ok")["input_ids"])
    assert tokenizer.decode(ids[:9]) == "Café — 日本\ufffd"  # half of 語
    done = [Completion("0:0", (1,), ids[:n], "length") for n in (5, 9, 11)]
    assert detokenize(done, tokenizer) == ["Café — ", "Café — 日本", "Café — 日本語"]


def test_cut_at_first_occurrence() -> None:
    assert cut_at_stop("a.b.c", ".") == "a"
    assert cut_at_stop("abc", None) == "abc"
    assert cut_at_stop("abc", "x") == "abc"
