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


def test_cut_at_the_first_occurrence_past_the_held_text_and_through_it_on_request() -> None:
    """min_tokens held the stop back from the first held_chars characters: the cut is at its
    first occurrence that ends after them; include_stop keeps the stop."""
    assert cut_at_stop("a.b.c", ".", held_chars=1) == "a"  # ends at 2 > 1
    assert cut_at_stop("a.b.c", ".", held_chars=2) == "a.b"
    assert cut_at_stop("a..b", "..", held_chars=2) == "a"  # begins inside, ends after
    assert cut_at_stop("a.b.c", ".", include_stop=True) == "a."
    assert cut_at_stop("a.b.c", ".", include_stop=True, held_chars=2) == "a.b."


def test_a_held_stop_is_cut_past_the_first_tokens_text(tiny_tokenizer: Any) -> None:
    """Completion.stop_held_tokens: the stop string ' is' first ends inside the first two tokens'
    text, which min_tokens held it back from; the text is cut at its next occurrence."""
    ids = tuple(tiny_tokenizer("Paris is the capital, it is.")["input_ids"])
    held = next(n for n in range(1, len(ids)) if tiny_tokenizer.decode(ids[:n]).endswith(" is"))
    done = [Completion("0:0", (1,), ids, "stop", stop_string=" is", stop_held_tokens=held),
            Completion("1:0", (1,), ids, "stop", stop_string=" is")]
    assert detokenize(done, tiny_tokenizer) == ["Paris is the capital, it", "Paris"]
    assert detokenize(done, tiny_tokenizer, include_stop=True) == [
        "Paris is the capital, it is", "Paris is"]
